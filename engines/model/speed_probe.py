"""How fast this machine runs the model being served: one decoder layer's decode step at a few
batch sizes, the same layer sharded for tp, the output head and one prefill chunk; and the share
of a core its cgroup's CPU quota leaves it (discovery/cgroup_cpu.py).

Measured on one- and five-layer models of the model's own architecture (mlx-lm's class, built
from its config, its weights a cheap repeating pattern: values never change the timing), so a
machine that has not received the model yet can be measured; a layer's time is a quarter of the
difference, the rest of the one-layer model is the head. The two models step in turns and each
point is the median of the pairs' differences: a difference of two timings taken seconds apart
moved a layer's time by 25% between runs.

A step is timed as this process's own work: its CPU time when that is less than the wall time
(a CPU quota's throttling, or another process on the core, adds wall time that says nothing of
this machine). That is the speed of a burst; what a busy machine sustains is the burst over its
share of a core, which every time reported here is.

`python -m engines.model.speed_probe` runs it as an agent's `speed_probe` role: a JSON spec on
stdin ({"config": ..., "rows": [...], "tp_sizes": [...], ...}), one ready line with the
measurement on stdout.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from engines.core import blas

blas.activate()  # before mlx loads: the BLAS the engines run on

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten, tree_map, tree_unflatten  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import _get_classes  # noqa: E402

from discovery.capabilities import read_bounded_memory  # noqa: E402
from discovery.cgroup_cpu import read_cpu_share  # noqa: E402
from discovery.json_child import run_measuring_role  # noqa: E402
from engines.model.gemm_layout import lay_out  # noqa: E402
from engines.model.packed_quantized import pack  # noqa: E402

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 4, 8, 16)  # sequences decoded together
CONTEXT_TOKENS = 8  # already in the KV cache when a decode step is timed (filling it is a prefill
# of rows x these tokens on both models, most of a point at 8 rows: 32 cost 0.85 s a probe here)
MIN_PAIRS = 5  # timed pairs of decode steps per point at least
POINT_BUDGET_S = 0.25  # ...and pairs for about this long (wall time: a quota slows the probe)
PREFILL_PAIRS = 1  # after its warm-up: a prefill chunk takes long and varies little
SMALLEST_S = 1e-7  # a difference of two timings is never below this
LONG_MODEL_LAYERS = 5
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
MB = 1 << 20
BUILD_HEADROOM = 1.25  # the patterned weights' temporaries and mlx's buffer cache, at most
MEMORY_MARGIN = 64 * MB  # decode caches and activations, and what other processes add meanwhile


def config_with(config: dict[str, Any], layers: int, ranks: int = 1) -> dict[str, Any]:
    """`config` with `layers` layers and, for a tp shard, 1/ranks of the heads and MLP."""
    changed = dict(config)
    for key in LAYER_KEYS:
        if key in changed:
            changed[key] = layers
    if ranks > 1:
        heads = int(config["num_attention_heads"])
        changed["head_dim"] = int(config.get("head_dim") or config["hidden_size"] // heads)
        changed["num_attention_heads"] = heads // ranks
        kv_heads = int(config.get("num_key_value_heads") or heads)
        changed["num_key_value_heads"] = max(kv_heads // ranks, 1)
        changed["intermediate_size"] = int(config["intermediate_size"]) // ranks
    return changed


def build_model(
    config: dict[str, Any], float32: bool, rest_from: nn.Module | None = None
) -> nn.Module:
    """The model of `config`, its weights in a cheap pattern; with `rest_from` (a model of the
    same config but its layer count), everything outside the layers is that model's arrays."""
    model = _shaped_model(config, float32, patterned=True)
    if rest_from is not None:
        model.update(tree_unflatten(_outside_layers(rest_from)))  # before any is computed
    mx.eval(model.parameters())
    return model


def _shaped_model(config: dict[str, Any], float32: bool, patterned: bool = False) -> nn.Module:
    """The model, its weights' shapes and dtypes final but nothing computed (mlx is lazy)."""
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if patterned:
        # Drawing random numbers for every weight took most of a build (3x that under a
        # 0.3-core quota); a repeating pattern times the same, values never change a matmul.
        model.update(tree_map(_patterned, model.parameters()))
    quantization = config.get("quantization")
    if isinstance(quantization, dict):
        nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"])
    elif not float32:
        model.set_dtype(mx.bfloat16)
    return model


def _outside_layers(model: nn.Module) -> list[tuple[str, mx.array]]:
    """The embedding, final norm and head: every weight not in a decoder layer."""
    inside = {id(array) for layer in model.layers for _, array in tree_flatten(layer.parameters())}
    return [
        (path, array) for path, array in tree_flatten(model.parameters()) if id(array) not in inside
    ]


def planned_bytes(config: dict[str, Any], tp_sizes: tuple[int, ...], float32: bool) -> int:
    """The weights `measure` holds at its peak: a one-layer model and the layers of a
    five-layer one sharing its rest, for the whole layer and then for each tp shard."""
    peak = 0
    for ranks in (1, *tp_sizes):
        model = _shaped_model(config_with(config, 1, ranks), float32)
        whole = sum(array.nbytes for _, array in tree_flatten(model.parameters()))
        rest = sum(array.nbytes for _, array in _outside_layers(model))
        peak = max(peak, rest + (1 + LONG_MODEL_LAYERS) * (whole - rest))
    return peak


class ProbeDoesNotFit(RuntimeError):
    """The probe would need more memory than the machine has free: it is skipped instead of
    letting the OOM killer choose a process (the largest in the cgroup may be serve's)."""


def check_fits(config: dict[str, Any], tp_sizes: tuple[int, ...], float32: bool) -> None:
    """Raise ProbeDoesNotFit, naming the numbers, when the probe's weights (with headroom for
    their temporaries) exceed the memory available now, within this process's cgroup."""
    needed = int(planned_bytes(config, tp_sizes, float32) * BUILD_HEADROOM) + MEMORY_MARGIN
    _, available, bound = read_bounded_memory(None)
    if needed > available:
        raise ProbeDoesNotFit(
            f"skipped: it needs ~{needed / MB:.0f} MB for its layers and "
            f"{available / MB:.0f} MB are available ({bound})"
        )


def _own_s(step: Callable[[], None]) -> float:
    """One step's seconds of this process's own work (see the module docstring)."""
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    return min(time.perf_counter() - wall, time.process_time() - cpu)


def _paired(
    short: Callable[[], None], long: Callable[[], None], min_pairs: int = MIN_PAIRS
) -> tuple[float, float]:
    """(the median of long minus short, the median of short) over pairs of steps taken in
    turns, after a warm-up of each (the first call compiles and allocates)."""
    short()
    long()
    differences: list[float] = []
    shorts: list[float] = []
    started = time.perf_counter()
    while len(differences) < min_pairs or time.perf_counter() - started < POINT_BUDGET_S:
        short_s, long_s = _own_s(short), _own_s(long)
        differences.append(long_s - short_s)
        shorts.append(short_s)
    return statistics.median(differences), statistics.median(shorts)


def _patterned(weight: mx.array) -> mx.array:
    """Small nonzero values in a repeating pattern, of `weight`'s shape and dtype."""
    pattern = (mx.arange(weight.size) % 13 - 6).astype(weight.dtype) * 0.01
    return pattern.reshape(weight.shape)


def decode_step(model: nn.Module, rows: int) -> Callable[[], None]:
    """A decode step of `rows` sequences with CONTEXT_TOKENS in their cache (which grows by a
    token a step, as serving's does)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((rows, CONTEXT_TOKENS), dtype=mx.int32), cache=cache))
    token = mx.ones((rows, 1), dtype=mx.int32)
    return lambda: mx.eval(model(token, cache=cache))


def _prefill_step(model: nn.Module, chunk: int) -> Callable[[], None]:
    """A prompt chunk into an empty cache; as the engines prefill, only the cache is computed
    (the logits of every position would be the output head over the whole chunk)."""
    tokens = mx.ones((1, chunk), dtype=mx.int32)

    def step() -> None:
        cache = make_prompt_cache(model)
        model(tokens, cache=cache)
        mx.eval([layer.state for layer in cache])

    return step


def layer_points(
    rows: tuple[int, ...], paired_at: Callable[[int], tuple[float, float]]
) -> list[tuple[int, float, float]]:
    """Per rows: (one layer's seconds, the rest's), from `paired_at(rows)`: the five-layer step
    minus the one-layer step, and the one-layer step."""
    points = []
    layer_floor = rest_floor = SMALLEST_S
    for count in rows:
        difference, short_s = paired_at(count)
        # more rows never cost less: a dip is noise, so each point is at least the last
        layer_floor = max(difference / (LONG_MODEL_LAYERS - 1), layer_floor)
        rest_floor = max(short_s - layer_floor, rest_floor)
        points.append((count, layer_floor, rest_floor))
    return points


def _layer_and_rest(config: dict[str, Any], ranks: int, rows: tuple[int, ...], float32: bool):
    """Per rows: (one layer's burst seconds, the rest's), from one- and five-layer models."""
    one = build_model(config_with(config, 1, ranks), float32)
    long = build_model(config_with(config, LONG_MODEL_LAYERS, ranks), float32, rest_from=one)
    if ranks == 1:  # as single and pipeline stages compute (tp ranks do not lay out)
        one, long = lay_out(one, long)
    one, long = pack(one, long)  # quantized layers as every engine computes them
    points = layer_points(
        rows, lambda count: _paired(decode_step(one, count), decode_step(long, count))
    )
    return one, long, points


def measure(
    config: dict[str, Any],
    rows: tuple[int, ...] = PROBE_ROWS,
    tp_sizes: tuple[int, ...] = (),
    prefill_chunk: int = 256,
    float32: bool = True,
) -> dict[str, Any]:
    """This machine's sustained speed for `config` as planner/speed.py's NodeSpeed reads it."""
    started = time.monotonic()
    share = read_cpu_share()
    one, long, points = _layer_and_rest(config, 1, rows, float32)
    prefills = (_prefill_step(model, prefill_chunk) for model in (one, long))
    difference, _ = _paired(*prefills, min_pairs=PREFILL_PAIRS)
    prefill = max(difference / (LONG_MODEL_LAYERS - 1), SMALLEST_S)
    del one, long  # the shards' models replace them: the probe's peak is the larger pair
    mx.clear_cache()
    shards = []
    for ranks in tp_sizes:
        _, _, shard_points = _layer_and_rest(config, ranks, rows, float32)
        shards.append([ranks, [[count, layer / share] for count, layer, _ in shard_points]])
    return {
        "layer": [[count, layer / share] for count, layer, _ in points],
        "head": [[count, rest / share] for count, _, rest in points],
        "prefill_layer_s": prefill / share,
        "prefill_chunk": prefill_chunk,
        "shards": shards,
        "cpu_share": round(share, 3),
        "probe_s": round(time.monotonic() - started, 3),
        "blas": blas.status().describe(),
    }


def measure_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """`measure` as the speed_probe role's spec asks, with its BLAS threads."""
    blas.set_threads(int(spec.get("blas_threads", 0)))
    tp_sizes = tuple(int(n) for n in spec.get("tp_sizes", ()))
    float32 = bool(spec.get("float32", True))
    check_fits(spec["config"], tp_sizes, float32)
    return measure(
        spec["config"],
        tuple(int(r) for r in spec.get("rows", PROBE_ROWS)),
        tp_sizes,
        int(spec.get("prefill_chunk", 256)),
        float32,
    )


if __name__ == "__main__":
    sys.exit(run_measuring_role("speed probe", "speed", measure_spec))
