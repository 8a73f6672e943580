"""Tests of sending model weights to agents."""
