"""A model shape with round numbers for planner tests: 32 layers of 1 MB, a tied 2 MB embedding."""

from __future__ import annotations

from planner import ModelShape

MB = 1024**2

# 32 layers of 1 MB plus a tied 2 MB embedding; KV: 2 * 8 heads * 64 dims * 2 bytes per token.
SHAPE = ModelShape(
    num_layers=32,
    hidden_size=512,
    attention_heads=16,
    kv_heads=8,
    head_dim=64,
    vocab_size=1024,
    weight_bytes=34 * MB,
    embedding_bytes=2 * MB,
    head_bytes=2 * MB,
    tied_embeddings=True,
    dtype_bytes=2,
    has_tp_variant=True,
)
