"""GGUF block types that are already mlx quantizations, repacked bit for bit (no floats).

Q8_0, Q4_0 and Q4_1 blocks are 32 codes with an fp16 scale (and, for Q4_1, an fp16 minimum):
mlx's affine quantization with group size 32, as `mx.load` of a GGUF gives them. MXFP4
blocks are 32 e2m1 codes under one e8m0 exponent: mlx's "mxfp4" mode. Only the code order
differs: a GGUF block keeps its first 16 codes in the low nibbles and the last 16 in the high
ones, where mlx packs codes in order, two to a byte, low nibble first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

GROUP_SIZE = 32  # codes per block in every native type
FP16_BYTES = 2


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """An mlx quantized weight: packed codes, scales and (affine only) biases, as numpy."""

    weight: np.ndarray  # (..., rows, columns * bits / 32) uint32
    scales: np.ndarray  # (..., rows, columns / 32) float16, or uint8 exponents for mxfp4
    biases: np.ndarray | None  # (..., rows, columns / 32) float16; None for mxfp4
    bits: int
    mode: str  # "affine" or "mxfp4"

    @property
    def group_size(self) -> int:
        return GROUP_SIZE


def repack(blocks: np.ndarray, quantization: GGMLQuantizationType) -> PackedWeight:
    """`blocks`: a tensor's raw bytes, (..., rows, blocks per row * block bytes) uint8."""
    if quantization == GGMLQuantizationType.Q8_0:
        return _repack_q8_0(blocks)
    if quantization == GGMLQuantizationType.Q4_0:
        return _repack_q4(blocks, has_minimum=False)
    if quantization == GGMLQuantizationType.Q4_1:
        return _repack_q4(blocks, has_minimum=True)
    if quantization == GGMLQuantizationType.MXFP4:
        return _repack_mxfp4(blocks)
    raise ValueError(f"{quantization.name} is not a native mlx quantization")


NATIVE_TYPES = frozenset(
    {
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.MXFP4,
    }
)


def _split_blocks(blocks: np.ndarray, block_bytes: int) -> tuple[tuple[int, ...], np.ndarray]:
    """(leading shape, (..., rows, blocks, block_bytes)) of a tensor's raw bytes."""
    shape = blocks.shape[:-1]
    count = blocks.shape[-1] // block_bytes
    return shape, np.ascontiguousarray(blocks).reshape(*shape, count, block_bytes)


def _fp16(grouped: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block: (..., rows, blocks)."""
    field = np.ascontiguousarray(grouped[..., start : start + FP16_BYTES])
    return field.view(np.float16)[..., 0]


def _pack_nibbles(codes: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """(..., rows, blocks, 32) codes in 0..15 -> (..., rows, columns / 8) uint32, mlx order."""
    pairs = (codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))).astype(np.uint8)
    return np.ascontiguousarray(pairs).reshape(*shape, -1).view(np.uint32)


def _block_nibbles(quads: np.ndarray) -> np.ndarray:
    """(..., 16) GGUF code bytes -> (..., 32) codes: low nibbles first, then high nibbles."""
    return np.concatenate([quads & np.uint8(0x0F), quads >> np.uint8(4)], axis=-1)


def _repack_q8_0(blocks: np.ndarray) -> PackedWeight:
    # Block: fp16 scale d, 32 int8 codes; value = d * q = d * (q + 128) - 128 * d.
    shape, grouped = _split_blocks(blocks, FP16_BYTES + GROUP_SIZE)
    scales = _fp16(grouped, 0)
    codes = grouped[..., FP16_BYTES:].view(np.int8).astype(np.int16) + 128
    weight = np.ascontiguousarray(codes.astype(np.uint8)).reshape(*shape, -1).view(np.uint32)
    biases = (scales * np.float16(-128)).astype(np.float16)  # exact: a power of two
    return PackedWeight(weight, scales, biases, bits=8, mode="affine")


def _repack_q4(blocks: np.ndarray, has_minimum: bool) -> PackedWeight:
    # Q4_0: fp16 d, 16 bytes; value = d * (q - 8). Q4_1: fp16 d, fp16 m, 16 bytes; d * q + m.
    header = 2 * FP16_BYTES if has_minimum else FP16_BYTES
    shape, grouped = _split_blocks(blocks, header + GROUP_SIZE // 2)
    scales = _fp16(grouped, 0)
    if has_minimum:
        biases = _fp16(grouped, FP16_BYTES)
    else:
        biases = (scales * np.float16(-8)).astype(np.float16)  # exact: a power of two
    weight = _pack_nibbles(_block_nibbles(grouped[..., header:]), shape)
    return PackedWeight(weight, scales, biases, bits=4, mode="affine")


def _repack_mxfp4(blocks: np.ndarray) -> PackedWeight:
    # Block: one e8m0 exponent e, 16 bytes of e2m1 codes; value = e2m1(q) * 2^(e - 127).
    shape, grouped = _split_blocks(blocks, 1 + GROUP_SIZE // 2)
    scales = np.ascontiguousarray(grouped[..., 0])
    weight = _pack_nibbles(_block_nibbles(grouped[..., 1:]), shape)
    return PackedWeight(weight, scales, None, bits=4, mode="mxfp4")
