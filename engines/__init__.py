"""What runs the model: the Engine interface, single / tensor-parallel / pipeline engines, and the HTTP API."""
