"""What runs the model: the Engine interface, single / tp / pp engines, and the HTTP API."""
