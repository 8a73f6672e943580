"""What the running plan really does, to show beside what the planner predicted for it: the
median decode speed per stream and time to first token of the requests it has served."""

from __future__ import annotations

import statistics
import threading
from collections import deque
from typing import Any

from engines.observability.request_timing import RequestRecord

RECENT = 200  # requests the medians are taken over


class ServedSpeed:
    """Request records of the current plan; reset() when a new plan starts serving."""

    def __init__(self) -> None:
        self._records: deque[RequestRecord] = deque(maxlen=RECENT)
        self._lock = threading.Lock()

    def observe(self, record: RequestRecord) -> None:
        if record.error is None and record.inter_token_s:
            with self._lock:
                self._records.append(record)

    def reset(self) -> None:
        with self._lock:
            self._records.clear()

    def describe(self) -> dict[str, Any]:
        """Medians over the plan's recent requests; decode speed is per stream, at whatever
        batch they shared (one stream at a time gives the 1-stream figure)."""
        with self._lock:
            records = list(self._records)
        if not records:
            return {"requests": 0}
        gaps = [record.inter_token_s for record in records if record.inter_token_s]
        ttfts = [r.time_to_first_token_s for r in records if r.time_to_first_token_s is not None]
        return {
            "requests": len(records),
            "decode_tps_per_stream": round(1 / statistics.median(gaps), 2),
            "ttft_ms": round(statistics.median(ttfts) * 1000, 1) if ttfts else None,
        }


def one_stream_segments_ms(step_timing: dict[str, Any] | None) -> dict[str, float]:
    """The mean milliseconds of each engine step segment over the decode steps taken while
    one sequence was alone in the engine (StepTimes' "one_row"): a 1-stream token's time,
    where the engine reports segments (pp and tp), to set beside the prediction's."""
    one_row = (step_timing or {}).get("one_row") or {}
    return {
        name: round(1000 * totals["sum"] / totals["count"], 2)
        for name, totals in one_row.items()
        if totals.get("count")
    }


def on_node(segment: str, nodes: list[str]) -> str:
    """A pipeline's segment with the node its stage runs on ("stage1 on vm-2", as
    engines/pipeline/frame_clock.py names stages, nodes in pipeline order); the hops and any
    other segment as they are."""
    index = segment.removeprefix("stage")
    if index == segment or not index.isdigit() or int(index) >= len(nodes):
        return segment
    return f"{segment} on {nodes[int(index)]}"
