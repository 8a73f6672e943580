"""One GGUF tensor -> its mlx-lm arrays (repacked, moved exactly, re-quantized or float), with
what the converter did to it undone."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, ReaderTensor, quants

from engines.model.gguf.affine import decode_affine
from engines.model.gguf.architectures import Architecture
from engines.model.gguf.native import repack
from engines.model.gguf.quantization import Treatment, treatment
from errors import ModelError

MLX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """What one GGUF tensor becomes: its mlx-lm name and treatment, decided before writing."""

    tensor: ReaderTensor
    name: str  # mlx-lm's, ending in .weight or .bias
    treatment: Treatment
    rope_heads: int | None  # un-interleave q/k rows over this many heads
    norm_offset: float  # subtract from the values (Gemma's norms)
    scales_dtype: str = ""  # of a quantized layer's scales and biases; "" = the float dtype

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]


def plan_tensor(
    tensor: ReaderTensor, architecture: Architecture, heads: int, kv_heads: int
) -> TensorPlan:
    """The plan for one tensor; a ModelError naming the tensor when nothing can convert it."""
    name = architecture.mlx_name(tensor.name)
    columns = int(tensor.shape[0])  # GGUF lists the fastest-moving dimension first
    try:
        how = treatment(GGMLQuantizationType(tensor.tensor_type), columns, len(tensor.shape))
    except ValueError as error:
        raise ModelError(
            f"GGUF tensor {tensor.name} has type {tensor.tensor_type.name}, which tandem cannot "
            f"convert ({error})"
        ) from None
    offset = architecture.norm_offset if architecture.is_norm(tensor.name) else 0.0
    rope = architecture.rope_heads(tensor.name, heads, kv_heads)
    return TensorPlan(tensor, name, how, rope, offset)


def convert(plan: TensorPlan, float_dtype: str) -> dict[str, mx.array]:
    """The arrays mlx-lm loads for this tensor: NAME (float) or NAME, scales, biases."""
    tensor = plan.tensor
    quantization = GGMLQuantizationType(tensor.tensor_type)
    dtype = MLX_DTYPES[float_dtype]
    scales_dtype = MLX_DTYPES[plan.scales_dtype or float_dtype]
    if plan.treatment.kind == "native":
        packed = repack(np.asarray(tensor.data), quantization)
        # mxfp4 scales are exponents (uint8); affine fp16 scales widen exactly.
        return _quantized(plan, packed.weight, packed.scales, packed.biases, scales_dtype)
    if plan.treatment.kind == "affine":
        affine = decode_affine(np.asarray(tensor.data), quantization)
        return _quantized(plan, affine.weight, affine.scales, affine.biases, scales_dtype)
    values = _rope_rows(dequantize(tensor), plan.rope_heads)
    if plan.norm_offset:
        values = values - np.float32(plan.norm_offset)
    array = mx.array(values).astype(dtype)
    if plan.treatment.kind == "float":
        return {plan.name: array}
    weight, scales, biases = mx.quantize(  # scales in the dtype of what it quantizes
        array.astype(scales_dtype), group_size=plan.treatment.group_size, bits=plan.treatment.bits
    )
    return {
        f"{plan.module}.weight": weight,
        f"{plan.module}.scales": scales,
        f"{plan.module}.biases": biases,
    }


def _quantized(
    plan: TensorPlan,
    weight: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray | None,
    dtype: mx.Dtype,
) -> dict[str, mx.array]:
    """A quantized layer's arrays, q/k rows back in HF order, float scales in `dtype`."""
    arrays = {"weight": mx.array(_rope_rows(weight, plan.rope_heads))}
    scales = _rope_rows(scales, plan.rope_heads)
    arrays["scales"] = (
        mx.array(scales) if scales.dtype == np.uint8 else mx.array(scales).astype(dtype)
    )
    if biases is not None:
        arrays["biases"] = mx.array(_rope_rows(biases, plan.rope_heads)).astype(dtype)
    return {f"{plan.module}.{key}": value for key, value in arrays.items()}


def dequantize(tensor: ReaderTensor) -> np.ndarray:
    """The tensor's values as float32, in numpy's order (rows of the GGUF's first dimension)."""
    quantization = GGMLQuantizationType(tensor.tensor_type)
    raw = np.asarray(tensor.data)
    if quantization == GGMLQuantizationType.F32:
        return raw.astype(np.float32, copy=False)
    if quantization == GGMLQuantizationType.F16:
        return raw.astype(np.float32)
    return quants.dequantize(raw, quantization)


def _rope_rows(values: np.ndarray, heads: int | None) -> np.ndarray:
    """Rows of a q or k projection back in HF's order: each head's two halves, not pairs."""
    if heads is None:
        return values
    rows = values.shape[0]
    head_dim = rows // heads
    order = np.arange(rows).reshape(heads, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)
    return values[order]
