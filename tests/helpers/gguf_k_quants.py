"""Q4_K and Q6_K encoders for tests: gguf-py decodes every K type but encodes none, and real
GGUFs are mostly Q4_K with Q6_K heads. Written from the block layouts gguf-py's decoder reads;
tests/model/gguf checks each pair."""

from __future__ import annotations

import numpy as np

SUPER_BLOCK = 256  # values per Q4_K block
SUB_BLOCK = 32  # values per (6-bit scale, 6-bit min) pair
SIX_BITS = 63
FOUR_BITS = 15
Q6_SUB_BLOCK = 16  # values per int8 scale in Q6_K
Q6_HALF = 128  # Q6_K packs each half of a block apart


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """(..., columns) float -> (..., columns / 256 * 144) uint8 Q4_K blocks.

    Each 32-value sub-block gets value = d * scale * q - dmin * min with q in 0..15, scale
    and min in 0..63, d and dmin one fp16 each per 256 values.
    """
    shape = values.shape
    blocks = values.astype(np.float32).reshape(-1, SUPER_BLOCK // SUB_BLOCK, SUB_BLOCK)
    low = np.minimum(blocks.min(axis=-1), 0.0)  # (B, 8): the offset is never positive
    high = blocks.max(axis=-1)
    step = (high - low) / FOUR_BITS
    d = (step.max(axis=-1) / SIX_BITS).astype(np.float16)  # (B,)
    dmin = (-low.min(axis=-1) / SIX_BITS).astype(np.float16)
    safe_d = np.where(d == 0, 1, d.astype(np.float32))[:, None]
    safe_dmin = np.where(dmin == 0, 1, dmin.astype(np.float32))[:, None]
    scales = np.clip(np.round(step / safe_d), 0, SIX_BITS).astype(np.uint8)
    minimums = np.clip(np.round(-low / safe_dmin), 0, SIX_BITS).astype(np.uint8)
    block_step = (d.astype(np.float32)[:, None] * scales)[..., None]
    block_low = (dmin.astype(np.float32)[:, None] * minimums)[..., None]
    codes = np.round((blocks + block_low) / np.where(block_step == 0, 1, block_step))
    codes = np.clip(codes, 0, FOUR_BITS).astype(np.uint8)  # (B, 8, 32)
    # 32 bytes per pair of sub-blocks: the first in the low nibbles, the second in the high.
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(len(blocks), -1)
    out = np.concatenate(
        [
            d.reshape(-1, 1).view(np.uint8),
            dmin.reshape(-1, 1).view(np.uint8),
            _pack_scales(scales, minimums),
            packed,
        ],
        axis=-1,
    )
    return out.reshape(*shape[:-1], -1)


def _pack_scales(scales: np.ndarray, minimums: np.ndarray) -> np.ndarray:
    """8 six-bit scales and 8 six-bit mins in 12 bytes: the first four of each whole in bytes
    0-7 (their top bits carrying the last four's top two), the last four's low bits in 8-11."""
    first, last = scales[:, :4], scales[:, 4:]
    first_min, last_min = minimums[:, :4], minimums[:, 4:]
    return np.concatenate(
        [
            first | ((last >> 4) << 6),
            first_min | ((last_min >> 4) << 6),
            (last & 0x0F) | ((last_min & 0x0F) << 4),
        ],
        axis=-1,
    ).astype(np.uint8)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """(..., columns) float -> (..., columns / 256 * 210) uint8 Q6_K blocks.

    value = d * scale * (q - 32), q in 0..63, an int8 scale per 16 values, one fp16 d per 256.
    """
    shape = values.shape
    blocks = values.astype(np.float32).reshape(-1, SUPER_BLOCK // Q6_SUB_BLOCK, Q6_SUB_BLOCK)
    step = np.abs(blocks).max(axis=-1) / 31  # (B, 16)
    d = (step.max(axis=-1) / 127).astype(np.float16)  # (B,)
    safe_d = np.where(d == 0, 1, d.astype(np.float32))[:, None]
    scales = np.clip(np.round(step / safe_d), -128, 127).astype(np.int8)
    block_step = (d.astype(np.float32)[:, None] * scales)[..., None]
    codes = np.round(blocks / np.where(block_step == 0, 1, block_step))
    codes = (np.clip(codes, -32, 31) + 32).astype(np.uint8).reshape(len(blocks), 2, Q6_HALF)
    low, high = codes & 0x0F, codes >> 4  # (B, 2 halves, 128)
    # Per half: 64 bytes of low nibbles (values j and j + 64), 32 bytes of 2-bit pairs
    # (values j, j + 32, j + 64, j + 96).
    ql = low[..., :64] | (low[..., 64:] << 4)
    qh = high[..., :32] | (high[..., 32:64] << 2) | (high[..., 64:96] << 4) | (high[..., 96:] << 6)
    out = np.concatenate(
        [
            ql.reshape(len(blocks), -1),
            qh.reshape(len(blocks), -1),
            scales.view(np.uint8),
            d.reshape(-1, 1).view(np.uint8),
        ],
        axis=-1,
    )
    return out.reshape(*shape[:-1], -1)
