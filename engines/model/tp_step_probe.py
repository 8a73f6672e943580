"""One decoder layer of a 2-rank tp group as it serves, its all_sums included: both ranks of
the collective probe's ring build the one- and five-layer models speed_probe measures (full
size), shard them with mlx-lm's own `Model.shard` as tp's ranks do, and step them in lockstep.

The isolated all_sum and a rank's shard alone under-predicted tp (the lab's 2 one-core machines
served 21.4 tok/s where ~26 was predicted): in the real forward the ranks drift apart during
compute and mlx's lazy graph syncs around each collective, which only a sharded forward shows.

Wall time, since a tp group runs in lockstep and sustained: a rank waiting for its peer waits
for real. A layer is a quarter of the five- and one-layer steps' difference (the median of
pairs taken in turns, as speed_probe's), the rest of the one-layer step is the embedding, head
and the step's own overhead.

Each rank also reports its own CPU time, layer and rest alike: its compute and the ring's
threads, which keep working while a rank waits at an all_sum (on the lab's one-core machines
a rank's CPU time per step equals the group's wall time). A rank held to a CPU quota cannot
step faster than that CPU time over its share, however quick a short burst of pairs ran.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.utils import _get_classes

from engines.model.speed_probe import (
    LONG_MODEL_LAYERS,
    build_model,
    config_with,
    decode_step,
    layer_points,
)

log = logging.getLogger(__name__)

MIN_PAIRS = 7  # the median of 7 stands even if the first pairs stalled rank 0's estimate
MAX_PAIRS = 40
POINT_BUDGET_S = 0.6  # timed pairs per rows: as many as rank 0's first pairs say fit in this


@dataclass(frozen=True, slots=True)
class TpSteps:
    """Per rows: (one layer's seconds, the rest's) of the group in wall time, the same in this
    rank's own CPU time, and the pairs timed at each rows."""

    wall: list[tuple[int, float, float]]
    cpu: list[tuple[int, float, float]]
    pairs: list[int]


def time_tp_steps(
    group: mx.distributed.Group,
    config: dict[str, Any],
    rows: tuple[int, ...],
    float32: bool,
    budget_s: float = POINT_BUDGET_S,
) -> TpSteps:
    """`config` sharded over `group`, stepped at each of `rows`. Every rank must run the same
    steps in the same order."""
    one = _sharded(config, 1, group, float32)
    long = _sharded(config, LONG_MODEL_LAYERS, group, float32, rest_from=one)
    pairs_timed: list[int] = []
    cpu_pairs: dict[int, tuple[float, float]] = {}

    def paired_at(count: int) -> tuple[float, float]:
        # each builds its cache with a prefill: both ranks in the same order
        short_step, long_step = decode_step(one, count), decode_step(long, count)
        wall, cpu, pairs = _lockstep_pairs(group, short_step, long_step, budget_s)
        pairs_timed.append(pairs)
        cpu_pairs[count] = cpu
        return wall

    wall = layer_points(rows, paired_at)
    cpu = layer_points(rows, cpu_pairs.__getitem__)
    log.info("tp layer and rest by rows: %s (CPU %s) over %s pairs", wall, cpu, pairs_timed)
    return TpSteps(wall, cpu, pairs_timed)


def has_tp_variant(config: dict[str, Any]) -> bool:
    """Whether mlx-lm's model for `config` can be sharded (has `Model.shard`). Every rank
    decides alike from the same config, so all of them skip the tp steps or none does."""
    try:
        model_class, _ = _get_classes(config)
    except (ValueError, KeyError):
        return False
    return hasattr(model_class, "shard")


def _sharded(
    config: dict[str, Any],
    layers: int,
    group: mx.distributed.Group,
    float32: bool,
    rest_from: Any = None,
):
    """The `layers`-layer model of `config`, sharded the way tp's ranks load theirs
    (engines/weights/tp_share.py `load_rank_share`: `Model.shard(group)`); with `rest_from`,
    its embedding, norm and head are that model's (as the speed probe's pair shares them)."""
    model = build_model(config_with(config, layers), float32, rest_from)
    model.shard(group)
    mx.eval(model.parameters())
    return model


Medians = tuple[float, float]  # (median of long minus short, median of short)


def _lockstep_pairs(
    group: mx.distributed.Group,
    short: Callable[[], None],
    long: Callable[[], None],
    budget_s: float,
) -> tuple[Medians, Medians, int]:
    """(wall medians, this process's CPU medians, pairs) over pairs stepped in turns. Rank 0
    picks the pair count from its first pairs and tells the others, as the all_sum rounds."""
    short()  # the first steps compile and allocate
    long()

    def pair() -> tuple[tuple[float, float], tuple[float, float]]:
        """((long, short) in wall seconds, (long, short) in CPU seconds)."""
        began, cpu_began = time.perf_counter(), time.process_time()
        short()
        middle, cpu_middle = time.perf_counter(), time.process_time()
        long()
        ended, cpu_ended = time.perf_counter(), time.process_time()
        return (ended - middle, middle - began), (cpu_ended - cpu_middle, cpu_middle - cpu_began)

    # the quicker of two: the first pairs after a build still stall now and then
    estimate_s = min(sum(pair()[0]) for _ in range(2))
    fitting = int(budget_s / max(estimate_s, 1e-9))
    pairs = from_rank_0(group, min(max(fitting, MIN_PAIRS), MAX_PAIRS))
    # the step after that sync may stall a scheduler tick (tensor_parallel/collective_probe.py)
    pair()
    wall, cpu = zip(*(pair() for _ in range(pairs)), strict=True)
    return _medians(wall), _medians(cpu), pairs


def _medians(timed: tuple[tuple[float, float], ...]) -> Medians:
    return (
        statistics.median(long_s - short_s for long_s, short_s in timed),
        statistics.median(short_s for _, short_s in timed),
    )


def from_rank_0(group: mx.distributed.Group, value: int) -> int:
    """Rank 0's `value` on every rank (the others add zeros)."""
    mine = value if group.rank() == 0 else 0
    return int(mx.distributed.all_sum(mx.array([mine], dtype=mx.int32), group=group).item())
