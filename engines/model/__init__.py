"""The model: its facts, where it is, its precision, load progress, the demo models."""
