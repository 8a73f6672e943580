"""The error an import leaves per GGML type, against the GGUF's own dequantized values.

Types gguf-py or tests/helpers/gguf_k_quants.py can encode are measured on Gaussian weights;
the others on random valid blocks (random bytes, kept when they decode to finite values of a
weight's size: every code equally likely, a harder case than real weights). docs/gguf.md's
table is `table()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor, quants

from engines.model.gguf.quantization import treatment
from engines.model.gguf.tensors import TensorPlan, convert
from tests.helpers.gguf_export import ENCODERS

T = GGMLQuantizationType
ROWS, COLUMNS = 64, 1024
ENCODED = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4})
TYPES = (
    T.Q8_0, T.Q4_0, T.Q4_1, T.MXFP4, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.Q3_K, T.Q2_K,
    T.IQ4_NL, T.IQ4_XS, T.IQ3_S, T.IQ3_XXS, T.IQ2_S, T.IQ2_XS, T.IQ2_XXS, T.IQ1_M, T.IQ1_S,
    T.BF16, T.F16,
)  # fmt: skip
LARGEST_VALUE = 8.0  # a block decoding to more is not weight-like: drawn again


@dataclass(frozen=True, slots=True)
class TypeError_:
    """One row of the table."""

    quantization: GGMLQuantizationType
    kind: str  # the import's treatment
    bits: int  # mlx bits per weight code (0: float)
    relative_rms: float  # rms(import - GGUF) / rms(GGUF)
    relative_max: float  # max |import - GGUF| / max |GGUF|


def gguf_blocks(quantization: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """A (ROWS, row bytes) tensor of `quantization`, encoded or drawn as valid random blocks."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((ROWS, COLUMNS)).astype(np.float32) * np.float32(0.05)
    if quantization in ENCODERS:
        return ENCODERS[quantization](weights)
    if quantization in ENCODED or quantization in (T.BF16,):
        return quants.quantize(weights, quantization)
    if quantization == T.F16:
        return weights.astype(np.float16)
    per_block, block_bytes = GGML_QUANT_SIZES[quantization]
    wanted = ROWS * COLUMNS // per_block
    kept: list[np.ndarray] = []
    while sum(len(chunk) for chunk in kept) < wanted:
        candidates = rng.integers(0, 256, (4096, block_bytes), dtype=np.uint8)
        with np.errstate(all="ignore"):  # random fp16 scales include NaNs and infinities
            values = quants.dequantize(candidates, quantization)
            peak = np.abs(values).max(axis=-1)
        good = np.isfinite(peak) & (peak < LARGEST_VALUE) & (peak > LARGEST_VALUE / 1000)
        kept.append(candidates[good])
    return np.concatenate(kept)[:wanted].reshape(ROWS, -1)


def measure(quantization: GGMLQuantizationType, seed: int = 0) -> TypeError_:
    """Import one tensor of the type through tandem's converter; compare with gguf-py's values."""
    raw = gguf_blocks(quantization, seed)
    truth = quants.dequantize(raw, quantization).astype(np.float32)
    how = treatment(quantization, COLUMNS, 2)
    tensor = ReaderTensor(
        name="blk.0.ffn_down.weight",
        tensor_type=quantization,
        shape=np.array([COLUMNS, ROWS], dtype=np.uint64),
        n_elements=ROWS * COLUMNS,
        n_bytes=raw.nbytes,
        data_offset=0,
        data=raw,
        field=None,
    )
    plan = TensorPlan(tensor, "model.layers.0.mlp.down_proj.weight", how, None, 0.0)
    arrays = convert(plan, "float32")
    imported = np.array(_values(arrays, how).astype(mx.float32))
    error = imported - truth
    return TypeError_(
        quantization,
        how.kind,
        how.bits,
        float(np.sqrt((error**2).mean()) / np.sqrt((truth**2).mean())),
        float(np.abs(error).max() / np.abs(truth).max()),
    )


def _values(arrays: dict[str, mx.array], how) -> mx.array:
    prefix = "model.layers.0.mlp.down_proj"
    if how.kind == "float":
        return arrays[f"{prefix}.weight"]
    return mx.dequantize(
        arrays[f"{prefix}.weight"],
        arrays[f"{prefix}.scales"],
        arrays.get(f"{prefix}.biases"),
        group_size=how.group_size,
        bits=how.bits,
        mode=how.mode,
    )


def table() -> str:
    """docs/gguf.md's table: every type, what the import does, the error it leaves."""
    lines = [
        "| GGML type | import | mlx bits | relative RMS error | relative max error |",
        "|---|---|---|---|---|",
    ]
    for quantization in TYPES:
        row = measure(quantization)
        bits = str(row.bits) if row.bits else "float"
        lines.append(
            f"| {quantization.name} | {row.kind} | {bits} | {row.relative_rms:.2e} "
            f"| {row.relative_max:.2e} |"
        )
    return "\n".join(lines)
