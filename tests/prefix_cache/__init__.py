"""Tests of the prefix cache on every engine."""
