"""What happened: step timing, per-request records, the request log, load progress."""
