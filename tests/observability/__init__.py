"""Tests of metrics, step timing and the request log."""
