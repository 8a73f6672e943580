"""Compute precision on the CPU: half-precision weights upcast to float32, where the BLAS runs.

mlx's CPU matmul has a BLAS path for float32 only: a bfloat16 model computes ~20x slower than
the same model in float32 (see docs/operations.md). On the CPU device, when the plan allows it,
the floating parameters of a non-quantized model are cast to float32 after loading; the planner
counts the doubled weights (engines/model/info.py.ModelFacts.to_shape).
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

log = logging.getLogger(__name__)

HALF = (mx.bfloat16, mx.float16)


def on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def upcast_on_cpu(module: Any, allowed: bool) -> str:
    """Cast `module`'s half-precision parameters to float32 when allowed and on the CPU;
    returns the dtype it computes in ("float32", "bfloat16", ...)."""
    dtypes = {value.dtype for _, value in tree_flatten(module.parameters())}
    half = [dtype for dtype in HALF if dtype in dtypes]
    if not half:
        return "float32" if mx.float32 in dtypes else str(next(iter(dtypes), "none"))
    native = str(half[0]).removeprefix("mlx.core.")
    if not (allowed and on_cpu()):
        return native
    module.set_dtype(mx.float32, predicate=lambda dtype: dtype in HALF)
    mx.eval(module.parameters())
    log.info("computing in float32 (weights upcast from %s on the CPU)", native)
    return "float32"
