"""Where a pipeline frame's time goes: each stage's layers, sealing, and the hops between."""

from __future__ import annotations

import time
from typing import Any

# The segments of one answered frame (engines/observability/step_timing.py), as the request log and
# /metrics name them:
# stage0      the coordinator's own layers (embedding, its layers, evaluation);
# stage1..N   each remote stage's layers (the last one's include the head and sampling);
# seal        sealing and opening frames, on the coordinator and on every stage;
# transit     the round trip less what the remote stages report: the network of every hop,
#             socket buffers, and waits behind other micro-batches (one-way hop times would
#             need synchronized clocks, so the hops are not split);
# round_trip  the frame sent (sealed and written) -> its answer opened, on the coordinator.
STAGE_ZERO, SEAL, TRANSIT, ROUND_TRIP = "stage0", "seal", "transit", "round_trip"
MICROSECONDS = 1_000_000


def stage_segment(index: int) -> str:
    return f"stage{index}"


def sealing_seconds(*channels: Any) -> float:
    """Seconds the channels spent sealing and opening (0 for a channel that does not count,
    like the benchmark's plaintext one)."""
    return sum(
        getattr(channel, "seal_seconds", 0.0) + getattr(channel, "open_seconds", 0.0)
        for channel in channels
    )


class StageMeter:
    """A remote stage's running totals for one session, appended to every frame it passes on.

    The totals run over the whole session (BEGIN and END frames too), not one frame: a frame
    cannot carry the time spent sealing itself, and totals let the coordinator take the
    difference between two answers.
    """

    def __init__(self, inbound: Any, outbound: Any) -> None:
        self._channels = (inbound, outbound)
        self.compute_s = 0.0

    def entry(self) -> tuple[int, int]:
        """(compute µs, sealing µs) so far."""
        sealing = sealing_seconds(*self._channels)
        return round(self.compute_s * MICROSECONDS), round(sealing * MICROSECONDS)


class FrameClock:
    """The coordinator's side for one session: when each frame left, and its answer's split.

    Each answer carries every remote stage's running totals; the segments of that answer are
    what the totals grew by since the previous answer. With one frame in flight that is
    exactly this frame's work; with several micro-batches in flight it is the work the stages
    did between two answers, which in a steady stream is one frame's worth.
    """

    def __init__(self, outbound: Any, inbound: Any) -> None:
        self._channels = (outbound, inbound)
        self._sealing = sealing_seconds(*self._channels)
        self._stages: dict[int, tuple[int, int]] = {}
        self._sent: dict[int, tuple[float, float]] = {}  # frame number -> (sent at, stage 0 s)

    def sent(self, number: int, stage_zero_s: float) -> None:
        self._sent[number] = (time.perf_counter(), stage_zero_s)

    def answered(self, number: int, times: tuple[tuple[int, int], ...]) -> dict[str, float]:
        """The segments of frame `number`, whose answer was just opened carrying `times`."""
        now = time.perf_counter()
        sent_at, stage_zero = self._sent.pop(number, (now, 0.0))
        round_trip = now - sent_at
        sealing = sealing_seconds(*self._channels)
        seal, self._sealing = sealing - self._sealing, sealing
        segments = {STAGE_ZERO: stage_zero}
        remote = 0.0
        for index, (compute_us, seal_us) in enumerate(times, start=1):
            last_compute, last_seal = self._stages.get(index, (0, 0))
            self._stages[index] = (compute_us, seal_us)
            compute = max(compute_us - last_compute, 0) / MICROSECONDS
            stage_seal = max(seal_us - last_seal, 0) / MICROSECONDS
            segments[stage_segment(index)] = compute
            seal += stage_seal
            remote += compute + stage_seal
        segments[SEAL] = seal
        segments[TRANSIT] = max(round_trip - remote, 0.0)
        segments[ROUND_TRIP] = round_trip
        return segments
