"""Tests of model facts, references, precision and the demo models."""
