"""What happened: step timing, per-request records and the request log."""
