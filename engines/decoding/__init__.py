"""Turning logits into tokens: sampling, grammars, the decode batch."""
