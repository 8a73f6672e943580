"""tandem's CPU kernel (engines/kernels) against mlx's own quantized matmul, on real mlx."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from engines import kernels
from engines.model.packed_quantized import PackedQuantizedLinear, pack

BITS = (2, 3, 4, 5, 6, 8)  # every width mlx's affine mode packs; GGUF imports keep 4, 5 and 8
# 1 row (a decode), 3 and 4 (one register block and its remainder), 7 (blocks of 4 and a
# rest), 40 (the BLAS on dequantized tiles)
ROWS = (1, 3, 4, 7, 40)


@pytest.fixture(scope="module")
def kernel():
    module = kernels.load()
    assert module is not None, kernels.unavailable_reason()  # x86-64 Linux builds it
    return module


def quantized(rows: int, columns: int, group_size: int, bits: int, dtype: mx.Dtype):
    weight = mx.random.normal((rows, columns), key=mx.random.key(rows + bits))
    codes, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
    return codes, scales.astype(dtype), biases.astype(dtype)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", (32, 64, 128))
@pytest.mark.parametrize("dtype", (mx.float32, mx.float16, mx.bfloat16))
@pytest.mark.parametrize("columns", (256, 1152))
def test_the_product_is_mlx_s_up_to_float_rounding(
    kernel, bits, group_size, dtype, columns
) -> None:
    # 97 weight rows: the last row's codes end where the buffer ends (the unpacker reads 8
    # bytes at a time, so that row goes through a padded copy). 1152 columns: more groups a
    # row than the 16 the integer dot's scales are read in, and a part block after them.
    codes, scales, biases = quantized(97, columns, group_size, bits, dtype)
    for rows in ROWS:
        x = mx.random.normal((rows, columns), key=mx.random.key(rows))
        ours = kernel.affine_matmul(x, codes, scales, biases, group_size, bits)
        theirs = mx.quantized_matmul(
            x,
            codes,
            scales.astype(mx.float32),
            biases.astype(mx.float32),
            group_size=group_size,
            bits=bits,
        )
        error = (mx.abs(ours - theirs).max() / mx.abs(theirs).max()).item()
        # float rounding; with the integer dot, x's rounding to int16 (2-3.5e-5 measured, a
        # tenth of float16's), itself checked to float rounding below
        assert error < (1e-4 if kernel.integer_dot() and rows < 32 else 2e-6), (rows, error)


@pytest.mark.parametrize("bits", BITS)
def test_the_integer_dot_is_its_rounding_of_x_exactly(kernel, bits) -> None:
    if not kernel.integer_dot():
        pytest.skip("built without AVX-512 VBMI and VNNI: the float path runs")
    group_size = 32
    codes, scales, biases = quantized(97, 256, group_size, bits, mx.float32)
    weights = np.array(mx.dequantize(codes, scales, biases, group_size, bits), np.float64)
    # s * (q - c) meets x rounded, b + s * c meets x as it is (c = 2 ** (bits - 1))
    offsets = np.repeat(np.array(biases, np.float64), group_size, axis=1)
    offsets += np.repeat(np.array(scales, np.float64), group_size, axis=1) * 2 ** (bits - 1)
    for rows in (1, 4, 7):
        x = np.array(mx.random.normal((rows, 256), key=mx.random.key(rows)))
        groups = x.reshape(rows, -1, group_size)
        top = np.abs(groups).max(-1, keepdims=True)  # float32 throughout, as the kernel
        codes_of_x = np.rint(groups * (np.float32(32767) / top))
        step = (top / np.float32(32767)).astype(np.float64)
        rounded = (codes_of_x * step).reshape(rows, 256)
        model = rounded @ (weights - offsets).T + x.astype(np.float64) @ offsets.T
        ours = np.array(kernel.affine_matmul(mx.array(x), codes, scales, biases, 32, bits))
        assert np.abs(ours - model).max() / np.abs(model).max() < 2e-6, rows


def test_leading_axes_and_strided_input(kernel) -> None:
    codes, scales, biases = quantized(64, 128, 32, 4, mx.float32)
    x = mx.random.normal((3, 2, 256), key=mx.random.key(1))[..., ::2]  # not contiguous
    ours = kernel.affine_matmul(x, codes, scales, biases, 32, 4)
    theirs = mx.quantized_matmul(x, codes, scales, biases, group_size=32, bits=4)
    assert ours.shape == (3, 2, 64)
    tolerance = 1e-4 if kernel.integer_dot() else 1e-5  # x's rounding, as above
    assert (mx.abs(ours - theirs).max() / mx.abs(theirs).max()).item() < tolerance


@pytest.mark.parametrize(
    "change, message",
    [
        ({"x": mx.ones((1, 128), dtype=mx.float16)}, "x must be float32"),
        ({"bits": 7}, "bits must be 2, 3, 4, 5, 6 or 8, not 7"),
        ({"x": mx.ones((1, 96))}, "w holds 128 codes a row, x has 96"),
        ({"scales": mx.ones((64, 3))}, "scales and biases must be (N, K / group_size)"),
    ],
)
def test_bad_arguments_are_refused_by_name(kernel, change, message) -> None:
    codes, scales, biases = quantized(64, 128, 32, 4, mx.float32)
    arguments = {
        "x": mx.ones((1, 128)),
        "w": codes,
        "scales": scales,
        "biases": biases,
        "group_size": 32,
        "bits": 4,
        **change,
    }
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kernel.affine_matmul(**arguments)


def test_a_quantized_model_decodes_mlx_s_greedy_tokens(kernel, demo_model_dir: Path) -> None:
    # Mixed widths as a GGUF import has them: 5 bits, the MLP's down projection at 8, the
    # tied embedding (the head) at 4.
    def quantize(model: nn.Module) -> nn.Module:
        def widths(path: str, module: nn.Module) -> dict | bool:
            if not hasattr(module, "to_quantized"):
                return False
            return {
                "group_size": 32,
                "bits": 8 if "down_proj" in path else 4 if "embed" in path else 5,
            }

        nn.quantize(model, class_predicate=widths)
        return model

    reference = quantize(load(str(demo_model_dir))[0])
    (packed,) = pack(quantize(load(str(demo_model_dir))[0]))
    assert any(isinstance(m, PackedQuantizedLinear) for m in packed.modules())
    prompt = mx.array([1, 17, 230, 5, 99, 42, 7, 300])
    logits_ours = packed(prompt[None])
    logits_theirs = reference(prompt[None])
    error = mx.abs(logits_ours - logits_theirs).max().item()
    # random weights through 8 layers: 2e-4 of the largest logit with the integer dot
    bound = 5e-4 * mx.abs(logits_theirs).max().item() if kernel.integer_dot() else 1e-3
    assert error < bound, error
    tokens = [
        [int(t) for t, _ in generate_step(prompt, model, max_tokens=24)]
        for model in (packed, reference)
    ]
    assert tokens[0] == tokens[1]
