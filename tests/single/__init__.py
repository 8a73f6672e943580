"""Tests of the single engine."""
