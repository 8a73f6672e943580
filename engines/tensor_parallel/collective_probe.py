"""How long one all_sum of a few hidden states takes between ranks: the collective tp runs twice
a layer, timed through mlx's own ring group over the same "ip:port" hostfile rows tp uses.

A ping over the control channel crosses tandem's encrypted channel, an all_sum mlx's ring
protocol: the planner prices tp's collectives from this where it was measured
(planner/speed.py).

`python -m engines.tensor_parallel.collective_probe` runs one rank as an agent's
`collective_probe` role: a JSON spec on stdin ({"rank", "hosts", "hidden_size", "rows",
"float32", "rounds", "budget_s", "timeout_s", and optionally the model's "config"}), one ready
line with the median seconds per all_sum by rows on stdout. With a config, both ranks then time
that model's decode step sharded over the same ring (engines/model/tp_step_probe.py): a tp
layer, all_sums included, and the rest of the step, by rows, in wall time and in the rank's own
CPU time.

mlx's ring init blocks (holding the GIL) until every rank has joined, so no Python thread can
time it out: faulthandler's C watchdog ends the process after `timeout_s`, and the parent
bounds its own wait, naming the peer that never came.
"""

from __future__ import annotations

import faulthandler
import logging
import statistics
import sys
import time
from typing import Any

from engines.core import blas

blas.activate()  # before mlx loads: the BLAS tp's ranks run on

import mlx.core as mx  # noqa: E402

from discovery.json_child import run_measuring_role  # noqa: E402
from engines.model.tp_step_probe import from_rank_0, has_tp_variant, time_tp_steps  # noqa: E402
from engines.tensor_parallel.group import WorkerSpec  # noqa: E402
from engines.tensor_parallel.worker import join_group  # noqa: E402

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 8)  # hidden states summed at once: one stream, a batch
WARMUP_ROUNDS = 3  # the first all_sums open the connections and allocate
MIN_ROUNDS = 5
MAX_ROUNDS = 40
BUDGET_S = 2.0  # timed rounds: as many as rank 0's warm-up says fit in this
TIMEOUT_S = 20.0  # joining and measuring; past it the process ends itself


def time_all_sums(
    group: mx.distributed.Group,
    hidden_size: int,
    rows: tuple[int, ...],
    dtype: mx.Dtype,
    rounds: int = MAX_ROUNDS,
    budget_s: float = BUDGET_S,
) -> tuple[dict[int, float], int]:
    """The median seconds of one all_sum of (rows, hidden_size) by rows, and the rounds timed.

    Sizes are interleaved so a slow moment weighs on all of them alike. Every rank must run the
    same all_sums, so rank 0 picks how many rounds fit the budget from its warm-up and tells
    the others once, before any is timed."""
    vectors = {count: mx.ones((count, hidden_size), dtype=dtype) for count in rows}
    mx.eval(*vectors.values())

    def round_of_all_sums() -> list[float]:
        seconds = []
        for vector in vectors.values():
            began = time.perf_counter()
            mx.eval(mx.distributed.all_sum(vector, group=group))
            seconds.append(time.perf_counter() - began)
        return seconds

    warmup_s = sum(sum(round_of_all_sums()) for _ in range(WARMUP_ROUNDS))
    fitting = int(budget_s / max(warmup_s / WARMUP_ROUNDS, 1e-9))
    rounds = from_rank_0(group, min(max(fitting, MIN_ROUNDS), rounds))
    # The all_sum after such a sync stalled a scheduler tick (4 ms) in about half the lab's
    # runs, skewing a median: one more untimed round takes that stall.
    round_of_all_sums()
    times = [round_of_all_sums() for _ in range(rounds)]
    medians = {
        count: statistics.median(t[index] for t in times) for index, count in enumerate(vectors)
    }
    return medians, rounds


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Join the ring `spec` describes and time its all_sums (see the module docstring)."""
    hosts = tuple(tuple(row) for row in spec["hosts"])  # one "ip:port" row per rank, as tp's
    rank = int(spec["rank"])
    group_spec = WorkerSpec(rank, len(hosts), "ring", model_path="", hosts=hosts)
    rows = tuple(sorted({int(count) for count in spec.get("rows", PROBE_ROWS)}))
    hidden_size = int(spec["hidden_size"])
    if hidden_size < 1 or not rows or rows[0] < 1:
        raise ValueError(f"hidden_size {hidden_size} and rows {list(rows)} must be >= 1")
    log.info("joining the ring as rank %d of %d: %s", rank, len(hosts), hosts)
    started = time.monotonic()
    group = join_group(group_spec)
    joined_s = time.monotonic() - started
    float32 = bool(spec.get("float32", True))
    dtype = mx.float32 if float32 else mx.bfloat16
    medians, rounds = time_all_sums(
        group,
        hidden_size,
        rows,
        dtype,
        int(spec.get("rounds", MAX_ROUNDS)),
        float(spec.get("budget_s", BUDGET_S)),
    )
    log.info("all_sum medians by rows: %s over %d rounds", medians, rounds)
    result: dict[str, Any] = {
        "ranks": group.size(),
        "all_sum": [[count, seconds] for count, seconds in medians.items()],
        "rounds": rounds,
    }
    config = spec.get("config")
    if isinstance(config, dict) and not has_tp_variant(config):
        log.info(
            "no tp layer timed: mlx-lm's %r model has no Model.shard", config.get("model_type")
        )
    elif isinstance(config, dict):
        steps = time_tp_steps(group, config, rows, float32)
        for suffix, points in (("", steps.wall), ("_cpu", steps.cpu)):
            result[f"tp_layer{suffix}"] = [[count, layer] for count, layer, _ in points]
            result[f"tp_rest{suffix}"] = [[count, rest] for count, _, rest in points]
        result["tp_pairs"] = steps.pairs
    result["join_s"] = round(joined_s, 3)
    result["probe_s"] = round(time.monotonic() - started, 3)
    return result


def measure_bounded(spec: dict[str, Any]) -> dict[str, Any]:
    """`measure`, ending this process past the spec's timeout."""
    # A C thread: it fires even while mlx's ring init holds the GIL waiting for a peer.
    faulthandler.dump_traceback_later(float(spec.get("timeout_s", TIMEOUT_S)), exit=True)
    result = measure(spec)
    faulthandler.cancel_dump_traceback_later()
    return result


if __name__ == "__main__":
    sys.exit(run_measuring_role("collective probe", "collective", measure_bounded))
