"""Tests of discovery, the control channel and the secure channel."""
