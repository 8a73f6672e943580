"""What each GGML tensor type becomes in mlx: repacked bit for bit ("native"), moved exactly into
mlx's affine form ("affine"), re-quantized ("requantized"), or float."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType

from engines.model.gguf.affine import AFFINE_TYPES, BITS
from engines.model.gguf.native import GROUP_SIZE, NATIVE_TYPES

T = GGMLQuantizationType
FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})
# Types that are no affine grid over 32 values (16-value sub-blocks, non-uniform codebooks):
# dequantized by gguf-py and re-quantized by mlx (group size 32) to the width here. The error
# each leaves against the GGUF's own values is measured in docs/gguf.md.
REQUANTIZED_BITS = {
    T.Q6_K: 8,  # 6 bits would double a Q6_K's own error; output heads are often Q6_K
    T.Q3_K: 4,
    T.Q2_K: 3,
    T.IQ4_NL: 5,
    T.IQ4_XS: 5,
    T.IQ3_S: 4,
    T.IQ3_XXS: 4,
    T.IQ2_S: 3,
    T.IQ2_XS: 3,
    T.IQ2_XXS: 3,
    T.IQ1_S: 3,
    T.IQ1_M: 3,
}
REQUANTIZED_GROUP_SIZE = 32
FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class Treatment:
    """How one tensor is carried over: "native" (repacked), "requantized" or "float"."""

    kind: str  # "native", "affine", "requantized" or "float"
    bits: int = 0  # of the mlx quantization; 0 for float
    group_size: int = 0
    mode: str = "affine"

    def quantization(self) -> dict[str, int | str] | None:
        """config.json's entry for the layer, None for float."""
        if self.kind == "float":
            return None
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    def output_bytes(self, elements: int, float_dtype: str, scales_dtype: str = "") -> int:
        """Bytes the tensor takes in the safetensors (codes plus scales and biases)."""
        if self.kind == "float":
            return elements * FLOAT_BYTES[float_dtype]
        groups = elements // self.group_size
        scale_bytes = FLOAT_BYTES[scales_dtype or float_dtype]
        extra = groups if self.mode == "mxfp4" else 2 * groups * scale_bytes
        return elements * self.bits // 8 + extra


def treatment(quantization: GGMLQuantizationType, columns: int, dimensions: int) -> Treatment:
    """What becomes of a tensor of this type with rows of `columns` values; None-free: types
    nothing handles raise ValueError (the caller names the tensor)."""
    if quantization in FLOAT_TYPES:
        return Treatment("float")
    if quantization in NATIVE_TYPES:
        mode = "mxfp4" if quantization == T.MXFP4 else "affine"
        bits = 8 if quantization == T.Q8_0 else 4
        return Treatment("native", bits, GROUP_SIZE, mode)
    if quantization in AFFINE_TYPES:
        return Treatment("affine", BITS[quantization], GROUP_SIZE)
    bits = REQUANTIZED_BITS.get(quantization)
    if bits is None:
        raise ValueError(f"no mlx counterpart for GGML type {quantization.name}")
    if dimensions < 2 or columns % REQUANTIZED_GROUP_SIZE:
        return Treatment("float")  # mlx quantizes rows in whole groups only
    return Treatment("requantized", bits, REQUANTIZED_GROUP_SIZE)


# Types whose block scales and offsets are float16 values in the GGUF itself (d, m, d * -16,
# d * -128), which float16 holds exactly; a K-quant's are products (d * a 6-bit scale).
HALF_EXACT_TYPES = NATIVE_TYPES | {T.Q5_0, T.Q5_1}


def scales_dtype(
    quantization: GGMLQuantizationType, how: Treatment, float_dtype: str, half_scales: bool
) -> str:
    """The dtype of a quantized layer's scales and biases ("" for a float tensor's own).

    `half_scales` (tandem's CPU kernel, which reads float16 scales as fast as float32 ones):
    float16 where it holds the GGUF's values exactly, and for what is re-quantized anyway, so
    a decode reads 2 bytes less per 32 weights (a tenth of a Q5_0 layer); else `float_dtype`.
    """
    if how.kind == "float" or not half_scales or float_dtype != "float32":
        return ""
    return "float16" if how.kind == "requantized" or quantization in HALF_EXACT_TYPES else ""
