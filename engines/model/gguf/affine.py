"""GGML types whose 32-value sub-blocks are affine grids (value = scale * code + bias), moved
into mlx's affine quantization exactly: Q5_0, Q5_1, Q4_K and Q5_K.

Each sub-block's scale and bias come from its block's header (fp16 d, and m or dmin; the K
types' packed 6-bit scales unpacked by gguf-py's own Q4_K.get_scale_min), the values from
gguf-py's dequantizer, and each code is (value - bias) / scale, exactly an integer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

GROUP_SIZE = 32
CHUNK_VALUES = 16 * 1024**2  # values decoded at once: a large embedding is GBs of float32
FP16_BYTES = 2
K_SCALES = slice(4, 16)  # the 12 bytes of packed 6-bit scales and mins after d and dmin
T = GGMLQuantizationType
BITS = {T.Q5_0: 5, T.Q5_1: 5, T.Q4_K: 4, T.Q5_K: 5}
AFFINE_TYPES = frozenset(BITS)


@dataclass(frozen=True, slots=True)
class AffineWeight:
    """mlx affine quantization of one tensor, as numpy: packed codes, scales, biases."""

    weight: np.ndarray  # (..., rows, columns * bits / 32) uint32
    scales: np.ndarray  # (..., rows, columns / 32) float32
    biases: np.ndarray  # (..., rows, columns / 32) float32
    bits: int


def decode_affine(raw: np.ndarray, quantization: GGMLQuantizationType) -> AffineWeight:
    """`raw`: the tensor's bytes (..., rows, row bytes) -> its exact mlx affine form."""
    rows = raw.reshape(-1, raw.shape[-1])
    block_values, block_bytes = GGML_QUANT_SIZES[quantization]
    step = max(1, CHUNK_VALUES // (rows.shape[-1] // block_bytes * block_values))
    parts = [
        _decode_rows(rows[start : start + step], quantization)
        for start in range(0, len(rows), step)
    ]
    lead = raw.shape[:-1]
    return AffineWeight(
        np.concatenate([part.weight for part in parts]).reshape(*lead, -1),
        np.concatenate([part.scales for part in parts]).reshape(*lead, -1),
        np.concatenate([part.biases for part in parts]).reshape(*lead, -1),
        BITS[quantization],
    )


def _decode_rows(raw: np.ndarray, quantization: GGMLQuantizationType) -> AffineWeight:
    """(rows, row bytes) -> codes, scales and biases of those rows."""
    bits = BITS[quantization]
    block_bytes = GGML_QUANT_SIZES[quantization][1]
    blocks = raw.reshape(-1, block_bytes)
    scale, bias = _grid(blocks, quantization)  # (blocks, groups a block)
    scale = scale.reshape(len(raw), -1)  # (rows, columns / 32)
    bias = bias.reshape(len(raw), -1)
    values = quants.dequantize(raw, quantization).reshape(*scale.shape, GROUP_SIZE)
    safe = np.where(scale == 0, 1, scale)[..., None]
    codes = np.rint((values - bias[..., None]) / safe)
    codes = np.clip(codes, 0, (1 << bits) - 1).astype(np.uint8)
    return AffineWeight(_pack(codes.reshape(len(raw), -1), bits), scale, bias, bits)


def _grid(blocks: np.ndarray, quantization: GGMLQuantizationType):
    """Each sub-block's (scale, bias) in float32, as gguf-py's dequantizer computes them."""
    d = _fp16(blocks, 0)
    if quantization == T.Q5_0:  # value = d * (q - 16)
        return d, d * np.float32(-16)
    if quantization == T.Q5_1:  # value = d * q + m
        return d, _fp16(blocks, FP16_BYTES)
    # Q4_K, Q5_K: value = d * scale_j * q - dmin * min_j over 8 sub-blocks of 32.
    dmin = _fp16(blocks, FP16_BYTES)
    scales, minimums = quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, K_SCALES]))
    return d * scales.astype(np.float32), -(dmin * minimums.astype(np.float32))


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block, as float32 (blocks, 1)."""
    field = np.ascontiguousarray(blocks[:, start : start + FP16_BYTES])
    return field.view(np.float16).astype(np.float32)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """(rows, columns) codes in mlx's order: one little-endian stream of `bits`-bit fields per
    row (4 bits: two codes a byte; 5 bits: 8 codes in 5 bytes)."""
    if bits == 4:
        return np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.uint32)
    eights = codes.reshape(len(codes), -1, 8).astype(np.uint32)
    low = eights[..., 0] | (eights[..., 1] << 5) | (eights[..., 2] << 10) | (eights[..., 3] << 15)
    high = eights[..., 4] | (eights[..., 5] << 5) | (eights[..., 6] << 10) | (eights[..., 7] << 15)
    # Two 20-bit halves: 40 bits, the first five bytes of low | high << 20 (little-endian).
    words = low.astype(np.uint64) | (high.astype(np.uint64) << np.uint64(20))
    stream = words[..., None].view(np.uint8)[..., :5]
    return np.ascontiguousarray(stream).reshape(len(codes), -1).view(np.uint32)
