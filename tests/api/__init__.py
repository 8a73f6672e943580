"""Tests of the OpenAI-compatible HTTP API."""
