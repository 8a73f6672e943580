"""Seeded weights for the hand-written demo families (llama, qwen3) and the safetensors writer
every demo model uses. The initial scales are tuned so that greedy generations wander instead
of repeating one token; names are sorted so that equal tensors give equal bytes.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from pathlib import Path

import numpy as np

from engines.model.demo_spec import DTYPES, DemoSpec

# Initial scales, tuned by measuring distinct tokens in greedy generations: unit-variance
# embeddings and fan-in-scaled linears with gain 2 make every layer's contribution outweigh
# the residual stream, so the output depends on the whole context and greedy decoding
# wanders instead of repeating one token. Logits get a standard deviation of HEAD_GAIN.
EMBEDDING_STD = 1.0
LINEAR_GAIN = 2.0
HEAD_GAIN = 4.0
TIED_EMBEDDING_STD = 0.6
GAINS = {
    "embedding_std": EMBEDDING_STD,
    "tied_embedding_std": TIED_EMBEDDING_STD,
    "linear_gain": LINEAR_GAIN,
    "head_gain": HEAD_GAIN,
}


def _make_weights(
    spec: DemoSpec, vocab_size: int, silent_ids: tuple[int, ...]
) -> dict[str, np.ndarray]:
    """Seeded float32 weights in mlx-lm's naming, drawn in one fixed order."""
    rng = np.random.default_rng(spec.seed)
    hidden, inner, head_dim = spec.hidden_size, spec.intermediate_size, spec.head_size

    def linear(out_features: int, in_features: int, gain: float = LINEAR_GAIN) -> np.ndarray:
        weight = rng.standard_normal((out_features, in_features), dtype=np.float32)
        return weight * np.float32(gain / np.sqrt(in_features))

    ones = functools.partial(np.ones, dtype=np.float32)
    embedding_std = TIED_EMBEDDING_STD if spec.tie_embeddings else EMBEDDING_STD
    embedding = rng.standard_normal((vocab_size, hidden), dtype=np.float32)
    weights = {"model.embed_tokens.weight": embedding * np.float32(embedding_std)}
    for index in range(spec.layers):
        prefix = f"model.layers.{index}"
        weights[f"{prefix}.input_layernorm.weight"] = ones(hidden)
        weights[f"{prefix}.self_attn.q_proj.weight"] = linear(spec.heads * head_dim, hidden)
        weights[f"{prefix}.self_attn.k_proj.weight"] = linear(spec.kv_heads * head_dim, hidden)
        weights[f"{prefix}.self_attn.v_proj.weight"] = linear(spec.kv_heads * head_dim, hidden)
        weights[f"{prefix}.self_attn.o_proj.weight"] = linear(hidden, spec.heads * head_dim)
        if spec.arch == "qwen3":
            weights[f"{prefix}.self_attn.q_norm.weight"] = ones(head_dim)
            weights[f"{prefix}.self_attn.k_norm.weight"] = ones(head_dim)
        weights[f"{prefix}.post_attention_layernorm.weight"] = ones(hidden)
        weights[f"{prefix}.mlp.gate_proj.weight"] = linear(inner, hidden)
        weights[f"{prefix}.mlp.up_proj.weight"] = linear(inner, hidden)
        weights[f"{prefix}.mlp.down_proj.weight"] = linear(hidden, inner)
    # Random signs on the final norm: with tied embeddings the current token's own embedding
    # in the residual would otherwise score highest and greedy decoding would repeat it.
    signs = np.where(rng.random(hidden) < 0.5, -1.0, 1.0).astype(np.float32)
    if spec.tie_embeddings:
        output = weights["model.embed_tokens.weight"]
        # Bring the logits to the spread an untied head gives: std HEAD_GAIN.
        weights["model.norm.weight"] = signs * np.float32(
            HEAD_GAIN / (embedding_std * np.sqrt(hidden))
        )
    else:
        output = weights["lm_head.weight"] = linear(vocab_size, hidden, HEAD_GAIN)
        weights["model.norm.weight"] = signs
    # Zero output rows score exactly 0, far below the best of ~1000 random logits, so greedy
    # decoding never picks them: no random EOS (generations run to max_tokens) and no lone
    # control or partial UTF-8 bytes (the text stays printable).
    output[list(silent_ids)] = 0.0
    return weights


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray], spec: DemoSpec) -> None:
    """Write a safetensors file with sorted names, so equal tensors give equal bytes."""
    tag = DTYPES[spec.dtype]
    blobs: list[bytes] = []
    header: dict[str, object] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name in sorted(tensors):
        blob = _encode(tensors[name], spec.dtype)
        header[name] = {
            "dtype": tag,
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header_bytes)))
        handle.write(header_bytes)
        for blob in blobs:
            handle.write(blob)
        handle.flush()
        os.fsync(handle.fileno())


def _encode(array: np.ndarray, dtype: str) -> bytes:
    array = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == "float32":
        return array.astype("<f4").tobytes()
    if dtype == "float16":
        return array.astype("<f2").tobytes()
    # bfloat16: the high half of float32, rounded to nearest even.
    bits = array.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()
