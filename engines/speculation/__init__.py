"""Speculative decoding: drafts checked by the model, several tokens per forward pass."""
