"""Linear layers over a few dozen rows, weights first, where the CPU's BLAS is faster that way.

mlx computes a Linear layer as `x @ W.T`. MKL's sgemm packs its right-hand operand into its own
layout on every call: with `W.T` on the right that is the whole weight matrix, and at 16 to 48
rows (a decode batch of that many streams, a pipeline's micro-batch) packing it costs about as
much as the product. `(W @ x.T).T` gives the same rows and packs only `x`. Which way is faster
depends on the CPU, the BLAS, its threads and the shape (a vocabulary-sized head loses either
way), so each float32 weight shape is timed both ways once, at load, and its layers take the
weights-first product only for the row counts where it measured faster (docs/benchmarks.md,
"Linear layers weights first").
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from engines.core import blas

log = logging.getLogger(__name__)

ROW_COUNTS = (16, 32, 48)  # rows timed: below, one product packs little; above, MKL amortizes
# Smaller weights are left alone: their products take tens of microseconds, less than what
# timing them costs at every load (the test suite loads hundreds of small demo models).
SMALLEST_WEIGHT = 1 << 19  # elements, e.g. 1024 x 512
MIN_GAIN = 1.1  # weights first only where it measured at least this much faster
WARMUPS, REPEATS = 1, 3

Rows = tuple[int, int]  # the row counts (first, last) a layer computes weights first
# (weight, rows) -> seconds of (x @ W.T, (W @ x.T).T) for `rows` rows
Timer = Callable[[mx.array, int], tuple[float, float]]


class WeightsFirstLinear(nn.Linear):
    """nn.Linear whose product over `rows` rows (first to last) is computed as (W @ x.T).T."""

    def __init__(self, linear: nn.Linear, rows: Rows) -> None:
        super().__init__(1, 1, bias="bias" in linear)
        self.update(linear.parameters())
        self.first_row, self.last_row = rows

    def __call__(self, x: mx.array) -> mx.array:
        count = x.size // x.shape[-1]
        if not self.first_row <= count <= self.last_row:
            return super().__call__(x)
        flat = x.reshape(count, x.shape[-1])
        y = (self.weight @ flat.T).T.reshape(*x.shape[:-1], self.weight.shape[0])
        return y + self.bias if "bias" in self else y


def time_both(weight: mx.array, rows: int) -> tuple[float, float]:
    """Median seconds of `x @ W.T` and of `(W @ x.T).T` (made contiguous) over `rows` rows."""
    x = mx.random.normal((rows, weight.shape[1]), dtype=weight.dtype)
    mx.eval(x)

    def seconds(product: Callable[[], mx.array]) -> float:
        for _ in range(WARMUPS):
            mx.eval(product())
        times = []
        for _ in range(REPEATS):
            started = time.perf_counter()
            mx.eval(product())
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    return seconds(lambda: x @ weight.T), seconds(lambda: mx.contiguous((weight @ x.T).T))


def faster_rows(weight: mx.array, timer: Timer | None = None) -> Rows | None:
    """The first run of ROW_COUNTS over which weights first was MIN_GAIN faster, or None."""
    timer = timer or time_both
    winning = [rows for rows in ROW_COUNTS if _gain(timer(weight, rows)) >= MIN_GAIN]
    if not winning:
        return None
    first = winning[0]
    last = first
    for rows in ROW_COUNTS[ROW_COUNTS.index(first) + 1 :]:
        if rows not in winning:
            break
        last = rows
    return first, last


def _gain(seconds: tuple[float, float]) -> float:
    usual, weights_first = seconds
    return usual / weights_first if weights_first > 0 else 0.0


def lay_out(*modules: Any, timer: Timer | None = None) -> list[Any]:
    """Each of `modules` (None passes through) with its float32 nn.Linear layers, or itself if
    it is one, swapped for WeightsFirstLinear where their shape measured faster; each shape is
    timed once for them all. Only where blas.weights_first_allowed(). Not for tensor-parallel
    ranks: each decides by its own clock, and a layer every rank computes must round alike on
    all of them."""
    if not blas.weights_first_allowed():
        return list(modules)
    decided: dict[tuple[int, ...], Rows | None] = {}

    def swap(_: str, layer: Any) -> Any:
        if (
            type(layer) is not nn.Linear
            or layer.weight.dtype != mx.float32
            or layer.weight.size < SMALLEST_WEIGHT
        ):
            return layer
        shape = tuple(layer.weight.shape)
        if shape not in decided:
            decided[shape] = faster_rows(layer.weight, timer)
        rows = decided[shape]
        return layer if rows is None else WeightsFirstLinear(layer, rows)

    laid_out = []
    for module in modules:
        if isinstance(module, nn.Linear):
            module = swap("", module)
        elif module is not None:
            leaves = tree_map_with_path(swap, module.leaf_modules(), is_leaf=nn.Module.is_module)
            module.update_modules(leaves)
        laid_out.append(module)
    chosen = {shape: rows for shape, rows in decided.items() if rows is not None}
    if chosen:
        log.info("linear layers computed weights first (shape: rows): %s", chosen)
    return laid_out
