"""The serving core: the Engine interface, the scheduler, sequences, the Service, the BLAS."""
