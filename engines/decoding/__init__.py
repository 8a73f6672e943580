"""Turning logits into tokens and text: sampling, grammars, stop strings."""
