"""Quantized layers on the CPU through tandem's kernel (engines/kernels), weights left packed.

After a model loads, each affine-quantized layer mlx-lm built (nn.QuantizedLinear, a tied
head's nn.QuantizedEmbedding, tensor parallelism's sharded linears) is swapped for a subclass
whose product calls `affine_matmul` on the same arrays: nothing is copied or re-packed, so
memory, the planner's byte counts and the weight files stay as they are, and mlx's own
`mx.quantized_matmul` still runs wherever the kernel cannot (another device or dtype, mxfp4).
The gated MLP's activation goes through the kernels too (engines/model/kernel_activations.py).
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
)
from mlx.utils import tree_map_with_path

from engines import kernels
from engines.model.kernel_activations import use_kernel_swiglu

log = logging.getLogger(__name__)


def packed_matmul(layer: Any, x: mx.array) -> mx.array | None:
    """x @ W.T through the kernel for a quantized `layer`, or None where it cannot run."""
    module = kernels.load()
    if (
        module is None
        or x.dtype != mx.float32
        or layer.mode != "affine"
        or layer.get("biases") is None
        or mx.default_device() != mx.cpu
    ):
        return None
    return module.affine_matmul(
        x, layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits
    )


class PackedQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        y = packed_matmul(self, x)
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class PackedQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:  # a tied head
        y = packed_matmul(self, x)
        return super().as_linear(x) if y is None else y


class PackedAllToShardedLinear(QuantizedAllToShardedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        y = packed_matmul(self, x)  # no gradients are taken: sum_gradients is not needed
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class PackedShardedToAllLinear(QuantizedShardedToAllLinear):
    def __call__(self, x: mx.array) -> mx.array:
        y = packed_matmul(self, x)
        if y is None:
            return super().__call__(x)
        y = mx.distributed.all_sum(y, group=self.group)
        return y + self["bias"] if "bias" in self else y


PACKED = {
    nn.QuantizedLinear: PackedQuantizedLinear,
    nn.QuantizedEmbedding: PackedQuantizedEmbedding,
    QuantizedAllToShardedLinear: PackedAllToShardedLinear,
    QuantizedShardedToAllLinear: PackedShardedToAllLinear,
}


def pack(*modules: Any) -> list[Any]:
    """Each of `modules` (None passes through) with its quantized layers, or itself if it is
    one, computing through the kernel; unchanged where the kernel is unavailable."""
    def quantized(module: Any) -> bool:
        return module is not None and any(type(m) in PACKED for m in module.modules())

    if not any(quantized(module) for module in modules) or kernels.load() is None:
        return list(modules)  # float models never load (or build) the kernel
    swapped = 0

    def swap(_: str, layer: Any) -> Any:
        nonlocal swapped
        packed = PACKED.get(type(layer))
        if packed is None:
            return layer
        layer.__class__ = packed  # same arrays and attributes; only the product differs
        swapped += 1
        return layer

    done = []
    for module in modules:
        if type(module) in PACKED:
            module = swap("", module)
        elif module is not None:
            leaves = tree_map_with_path(swap, module.leaf_modules(), is_leaf=nn.Module.is_module)
            module.update_modules(leaves)
        done.append(module)
        if module is not None and type(module) not in PACKED.values():
            use_kernel_swiglu(module)
    if swapped:
        log.info("%d quantized layers computed by tandem's CPU kernel", swapped)
    return done


def runs_on_kernel(model: Any) -> bool:
    """Whether any of `model`'s layers computes through the kernel (pack swapped it)."""
    swapped = tuple(PACKED.values())
    return any(isinstance(layer, swapped) for layer in model.modules())
