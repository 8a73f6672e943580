"""mlx-lm's gated-MLP activation, `swiglu(gate, x) = silu(gate) * x`, through tandem's kernel.

mlx's CPU build computes its exp one float at a time on one thread: in a 256-token prefill
chunk of Qwen2.5-Coder-1.5B that is ~40 ms of a layer's ~320 (engines/kernels/swiglu.cpp
takes ~1.2 ms, within 2e-6 of mlx). mlx-lm's architectures import `swiglu` by name from
`mlx_lm.models.activations`, so each architecture module a model uses is pointed at
`kernel_swiglu`, which hands anything the kernel does not take (another dtype or device,
broadcast shapes) back to mlx-lm's own.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models.activations import swiglu as mlx_swiglu

from engines import kernels


def kernel_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    module = kernels.load()
    if (
        module is None
        or gate.dtype != mx.float32
        or x.dtype != mx.float32
        or gate.shape != x.shape
        or mx.default_device() != mx.cpu
    ):
        return mlx_swiglu(gate, x)
    return module.swiglu(gate, x)


def use_kernel_swiglu(model: Any) -> int:
    """Point the architecture modules of `model`'s layers at kernel_swiglu; how many were."""
    pointed = 0
    for name in {type(layer).__module__ for layer in model.modules()}:
        module = sys.modules.get(name)
        if getattr(module, "swiglu", None) is mlx_swiglu:
            module.swiglu = kernel_swiglu
            pointed += 1
    return pointed
