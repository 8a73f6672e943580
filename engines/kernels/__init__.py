"""tandem's own CPU kernels for mlx: a compiled extension, loaded once per process.

mlx's CPU quantized matmul widens every code to a float in a scalar loop, on one thread: a
0.5B GGUF decodes ~1 token/s. `affine_matmul` (affine_matmul.cpp) reads the packed codes as
mlx stores them, on every core, and hands prefill-sized products to the BLAS. It is an mlx
primitive: it stays in the lazy graph, no synchronisation per layer.

`load()` gives the module, building it first if this machine has no build (build.py), or
None with the reason logged once: no compiler, not x86-64 Linux, `--cpu-kernels off`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
import sys
from types import ModuleType

from engines.core import blas

log = logging.getLogger(__name__)

CHOICES = ("auto", "off")

_loaded: tuple[ModuleType | None, str] | None = None


def load() -> ModuleType | None:
    """The kernels' module, or None (why: `unavailable_reason()`)."""
    global _loaded
    if _loaded is None:
        _loaded = _load()
        if _loaded[0] is None:
            log.warning(
                "tandem's CPU kernels are off, mlx's own quantized matmul runs: %s", _loaded[1]
            )
    return _loaded[0]


def unavailable_reason() -> str:
    load()
    return _loaded[1] if _loaded else ""


def _load() -> tuple[ModuleType | None, str]:
    choice = blas.cpu_kernels_choice()
    if choice not in CHOICES:
        return None, f"{blas.KERNELS_ENV}={choice!r} is not one of {CHOICES}"
    if choice == "off":
        return None, "turned off (--cpu-kernels off)"
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None, f"written for x86-64 Linux, this is {sys.platform} {platform.machine()}"
    from engines.kernels.build import MODULE_NAME, KernelBuildError, built_module, ensure_built

    try:
        ensure_built()
    except KernelBuildError as error:
        return None, str(error)
    path = built_module()
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    if spec is None or spec.loader is None:
        return None, f"cannot load {path}"
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as error:
        return None, f"cannot load {path}: {error}"
    reason = _self_check(module)
    if reason:
        return None, reason
    threads = blas.status().threads or (os.cpu_count() or 1)
    module.set_threads(threads)
    log.info("tandem's CPU kernels: %s, %d thread(s)", path, threads)
    return module, ""


def _self_check(module: ModuleType) -> str:
    """'' if the module multiplies a small matrix as mlx does, else why not (an mlx built
    with another nanobind ABI rejects the arrays)."""
    import mlx.core as mx

    weights = mx.arange(64 * 32, dtype=mx.float32).reshape(64, 32) / 1000.0
    codes, scales, biases = mx.quantize(weights, group_size=32, bits=4)
    x = mx.ones((1, 32))
    try:
        ours = module.affine_matmul(x, codes, scales, biases, 32, 4)
    except TypeError as error:
        return f"the extension does not accept this mlx's arrays: {error}"
    theirs = mx.quantized_matmul(x, codes, scales, biases, group_size=32, bits=4)
    if not mx.allclose(ours, theirs, rtol=1e-5, atol=1e-5).item():
        return "the extension's self-check gave another product than mlx's"
    return ""
