"""The model: its facts, where it is, its precision, the demo models."""
