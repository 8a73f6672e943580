"""The gated MLP's activation on tandem's kernel (engines/kernels/swiglu.cpp) against mlx-lm's
own `swiglu`, on real mlx: elementwise, where it hands back to mlx, and a model's tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.activations import swiglu as mlx_swiglu

from engines import kernels
from engines.model.kernel_activations import kernel_swiglu, use_kernel_swiglu

# 1 and 7 (no whole vector), 8960 (Qwen2.5-Coder-1.5B's MLP), 40000 (three pool chunks)
SIZES = (1, 7, 8960, 40000)
EXTREMES = [-1e4, -200.0, -88.0, -87.0, -20.0, -1e-8, 0.0, 1e-8, 0.5, 20.0, 88.0, 1e4]


@pytest.fixture(scope="module")
def kernel():
    module = kernels.load()
    assert module is not None, kernels.unavailable_reason()  # x86-64 Linux builds it
    return module


@pytest.mark.parametrize("size", SIZES)
def test_it_is_mlx_s_swiglu_up_to_float_rounding(kernel, size: int) -> None:
    gate = 8 * mx.random.normal((2, size), key=mx.random.key(size))
    x = mx.random.normal((2, size), key=mx.random.key(size + 1))
    ours, theirs = kernel.swiglu(gate, x), mlx_swiglu(gate, x)
    assert ours.shape == theirs.shape and ours.dtype == mx.float32
    assert (mx.abs(ours - theirs) / mx.maximum(mx.abs(theirs), 1e-30)).max().item() < 1e-5


def test_the_tails_of_the_exp_stay_finite(kernel) -> None:
    gate, x = mx.array(EXTREMES), mx.ones(len(EXTREMES))
    ours, theirs = kernel.swiglu(gate, x), mlx_swiglu(gate, x)
    assert mx.allclose(ours, theirs, rtol=1e-5, atol=1e-30).item(), (ours, theirs)


def test_what_the_kernel_does_not_take_is_mlx_s() -> None:
    gate = mx.random.normal((3, 16), key=mx.random.key(3))
    half = gate.astype(mx.float16)
    assert mx.array_equal(kernel_swiglu(half, half), mlx_swiglu(half, half)).item()
    row = mx.random.normal((16,), key=mx.random.key(4))  # broadcast against gate
    assert mx.array_equal(kernel_swiglu(gate, row), mlx_swiglu(gate, row)).item()


def test_a_model_gives_mlx_s_greedy_tokens(
    kernel, demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = load(str(demo_model_dir))
    architecture = sys.modules[type(model.layers[0].mlp).__module__]
    monkeypatch.setattr(architecture, "swiglu", mlx_swiglu)  # whatever an earlier test did
    prompt = mx.array([1, 17, 230, 5, 99, 42, 7, 300])

    def greedy() -> list[int]:
        return [int(token) for token, _ in generate_step(prompt, model, max_tokens=24)]

    reference = greedy()
    assert use_kernel_swiglu(model) == 1 and architecture.swiglu is kernel_swiglu
    assert greedy() == reference
