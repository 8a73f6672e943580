"""Tests of the serving core."""
