"""StepTimes: where an engine's steps spend their time, per segment, and per request."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Mapping

# Upper bounds (seconds) of the step histograms: a collective on loopback takes ~0.1 ms, a
# long prefill chunk on a big model seconds.
STEP_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)


class _Histogram:
    """One segment's observations: count, sum and per-bucket counts (not cumulative)."""

    __slots__ = ("buckets", "count", "total")

    def __init__(self) -> None:
        self.buckets = [0] * (len(STEP_BUCKETS) + 1)  # the last one is +Inf
        self.count = 0
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.buckets[bisect.bisect_left(STEP_BUCKETS, seconds)] += 1
        self.count += 1
        self.total += seconds

    def snapshot(self) -> dict[str, object]:
        cumulative, running = [], 0
        for bound, count in zip((*STEP_BUCKETS, "+Inf"), self.buckets, strict=True):
            running += count
            cumulative.append([bound, running])  # "+Inf" as text: the detail goes out as JSON
        return {"count": self.count, "sum": self.total, "buckets": cumulative}


class StepTimes:
    """Histograms of an engine's step segments, and each running request's share of them.

    The engine calls `observe` once per step (tp) or per answered frame (pp) with the
    seconds of each segment and the uids the step carried: every one of them is charged the
    whole step (a batched step is shared, not split). `request(uid)` is what the request log
    shows; `forget` drops a request once it left the batch. One thread observes (the
    scheduler), any thread may take a `snapshot` (a /metrics scrape).

    Steps the engine marks `decode=True` (a decode step with no other sequence in the engine)
    that carried one uid are also summed apart: what a 1-stream token costs, the figure the
    measured planner predicts (planner/speed.py `Prediction.segments`); a prompt's chunks, or
    a lone row waiting behind another micro-batch, would skew it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._segments: dict[str, _Histogram] = {}
        self._one_row: dict[str, list[float]] = {}  # segment -> [steps, seconds]
        self._requests: dict[int, dict[str, float]] = {}
        self.steps = 0

    def observe(
        self, segments: Mapping[str, float], uids: Iterable[int] = (), decode: bool = False
    ) -> None:
        uids = list(uids)
        one_stream = decode and len(uids) == 1
        with self._lock:
            self.steps += 1
            for name, seconds in segments.items():
                seconds = max(seconds, 0.0)
                histogram = self._segments.get(name)
                if histogram is None:
                    histogram = self._segments[name] = _Histogram()
                histogram.observe(seconds)
                if one_stream:
                    totals = self._one_row.setdefault(name, [0, 0.0])
                    totals[0] += 1
                    totals[1] += seconds
            for uid in uids:
                shares = self._requests.setdefault(uid, {})
                for name, seconds in segments.items():
                    shares[name] = shares.get(name, 0.0) + max(seconds, 0.0)

    def request(self, uid: int) -> dict[str, float]:
        """The seconds of every step that carried `uid`, by segment (empty when none did)."""
        with self._lock:
            return dict(self._requests.get(uid, {}))

    def forget(self, uids: Iterable[int]) -> None:
        with self._lock:
            for uid in uids:
                self._requests.pop(uid, None)

    def snapshot(self) -> dict[str, object]:
        """`{"steps": n, "segments": {name: {"count", "sum", "buckets": [[le, cumulative]]}},
        "one_row": {name: {"count", "sum"}}}`, what info().detail["step_timing"] holds and
        /metrics turns into histograms."""
        with self._lock:
            segments = {name: value.snapshot() for name, value in self._segments.items()}
            one_row = {
                name: {"count": int(count), "sum": total}
                for name, (count, total) in self._one_row.items()
            }
            return {"steps": self.steps, "segments": segments, "one_row": one_row}
