"""StepClock: how long rank 0 spends on a lockstep step, and how much of it in `all_sum`s."""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from engines.tensor_parallel.lockstep import Lockstep

# The segments of a tp step (observability/step_timing.py), as the request log and /metrics name
# them:
# all_sum   rank 0's lockstep collectives (the command broadcasts and the checksum sync),
#           waiting for the slowest rank included;
# compute   the rest of rank 0's step: finishing the forward pass mlx-lm queued one step
#           ahead (the sharded layers' own all_sums run inside it) and the batch's changes;
# step      rank 0's whole step (all_sum + compute);
# exchange  the coordinator's view: the step command written -> rank 0's answer read.
ALL_SUM, COMPUTE, STEP, EXCHANGE = "all_sum", "compute", "step", "exchange"


class StepClock:
    """Started by rank 0 before it broadcasts a command, read once the step is done.

    mlx-lm's batch generator queues the next forward pass before it returns, and the
    broadcast's `all_sum` runs behind it on the same stream: the clock first waits for that
    queue to drain (rank 0 would wait for it inside the broadcast anyway), so the time in
    the collectives is not mistaken for compute.
    """

    def __init__(self, lockstep: Lockstep) -> None:
        self._lockstep = lockstep
        self._started = time.perf_counter()
        mx.synchronize(generation_stream)
        self._collectives = lockstep.seconds

    def read(self) -> dict[str, float]:
        """{"all_sum": s, "step": s} of the step since the clock started."""
        step = time.perf_counter() - self._started
        all_sum = self._lockstep.seconds - self._collectives
        return {ALL_SUM: round(all_sum, 6), STEP: round(step, 6)}


def step_segments(timing: Any, exchange_s: float) -> dict[str, float]:
    """The segments of one step from rank 0's answer (`timing`, absent from an older worker)
    and the coordinator's own round trip."""
    segments = {EXCHANGE: exchange_s}
    if isinstance(timing, dict):
        all_sum, step = float(timing.get(ALL_SUM, 0.0)), float(timing.get(STEP, 0.0))
        segments |= {ALL_SUM: all_sum, COMPUTE: max(step - all_sum, 0.0), STEP: step}
    return segments
