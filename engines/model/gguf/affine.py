"""GGML types whose 32-value sub-blocks are affine grids (value = scale * code + bias), moved
into mlx's affine quantization exactly: Q5_0, Q5_1, Q4_K and Q5_K.

Their scales and biases are spread over packed 6-bit fields, so rather than decode each layout
they are read through gguf-py's own dequantizer: the blocks with every code set to 0 give each
sub-block's bias, with every code 1 its bias + scale, and the codes follow from the values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

GROUP_SIZE = 32
CHUNK_VALUES = 16 * 1024**2  # values decoded at once
T = GGMLQuantizationType


@dataclass(frozen=True, slots=True)
class CodeLayout:
    """Where a block keeps its codes: the low four bits two to a byte, the fifth bit apart."""

    bits: int
    low_nibbles: tuple[int, int]  # byte range in the block
    high_bits: tuple[int, int] | None = None


LAYOUTS = {
    T.Q5_0: CodeLayout(5, low_nibbles=(6, 22), high_bits=(2, 6)),
    T.Q5_1: CodeLayout(5, low_nibbles=(8, 24), high_bits=(4, 8)),
    T.Q4_K: CodeLayout(4, low_nibbles=(16, 144)),
    T.Q5_K: CodeLayout(5, low_nibbles=(48, 176), high_bits=(16, 48)),
}
AFFINE_TYPES = frozenset(LAYOUTS)


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
    # Some rows at a time: a 150k-token embedding is 3 GB of float32 per decode.
    step = max(1, CHUNK_VALUES // (rows.shape[-1] // block_bytes * block_values))
    parts = [
        _decode_rows(rows[start : start + step], quantization)
        for start in range(0, len(rows), step)
    ]
    bits = LAYOUTS[quantization].bits
    lead = raw.shape[:-1]
    return AffineWeight(
        np.concatenate([part.weight for part in parts]).reshape(*lead, -1),
        np.concatenate([part.scales for part in parts]).reshape(*lead, -1),
        np.concatenate([part.biases for part in parts]).reshape(*lead, -1),
        bits,
    )


def _decode_rows(raw: np.ndarray, quantization: GGMLQuantizationType) -> AffineWeight:
    layout = LAYOUTS[quantization]
    block_bytes = GGML_QUANT_SIZES[quantization][1]
    values = quants.dequantize(raw, quantization)  # (rows, columns)
    bias = _first_of_groups(
        quants.dequantize(_with_codes(raw, layout, block_bytes, 0), quantization)
    )
    step = _first_of_groups(
        quants.dequantize(_with_codes(raw, layout, block_bytes, 1), quantization)
    )
    scale = step - bias  # (rows, columns / 32)
    grouped = values.reshape(*scale.shape, GROUP_SIZE)
    safe = np.where(scale == 0, 1, scale)[..., None]
    codes = np.rint((grouped - bias[..., None]) / safe)
    codes = np.clip(codes, 0, (1 << layout.bits) - 1).astype(np.uint8)
    return AffineWeight(_pack(codes, layout.bits, values.shape), scale, bias, layout.bits)


def _with_codes(raw: np.ndarray, layout: CodeLayout, block_bytes: int, code: int) -> np.ndarray:
    """A copy of the blocks with every code set to `code` (0 or 1), scales left as they are."""
    blocks = raw.reshape(-1, block_bytes).copy()
    start, end = layout.low_nibbles
    blocks[:, start:end] = 0x11 * code
    if layout.high_bits is not None:
        start, end = layout.high_bits
        blocks[:, start:end] = 0
    return blocks.reshape(raw.shape)


def _first_of_groups(values: np.ndarray) -> np.ndarray:
    """Every group's first value: in a probe all of a group's values are equal."""
    return np.ascontiguousarray(values[..., ::GROUP_SIZE])


def _pack(codes: np.ndarray, bits: int, shape: tuple[int, ...]) -> np.ndarray:
    """Codes in mlx's order: one little-endian stream of `bits`-bit fields per row."""
    fields = np.unpackbits(codes[..., None], axis=-1, bitorder="little")[..., :bits]
    stream = np.packbits(fields.reshape(*shape[:-1], -1), axis=-1, bitorder="little")
    return np.ascontiguousarray(stream).view(np.uint32)
