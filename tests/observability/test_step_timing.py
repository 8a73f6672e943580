"""StepTimes' histograms and per-request shares, and how the pipeline splits an answer."""

from __future__ import annotations

import time

import pytest

from engines.observability.served_speed import one_stream_segments_ms
from engines.observability.step_timing import STEP_BUCKETS, StepTimes
from engines.pipeline.frame_clock import FrameClock, StageMeter
from engines.tensor_parallel.step_clock import step_segments


def test_every_request_in_a_step_is_charged_the_whole_step() -> None:
    times = StepTimes()
    times.observe({"all_sum": 0.002, "step": 0.01}, [1, 2])
    times.observe({"all_sum": 0.003, "step": 0.02}, [2])
    times.observe({"all_sum": -1.0, "step": 20.0})  # a clock oddity counts as 0; no request
    assert times.request(1) == pytest.approx({"all_sum": 0.002, "step": 0.01})
    assert times.request(2) == pytest.approx({"all_sum": 0.005, "step": 0.03})
    times.forget([2])
    assert times.request(2) == {}
    snapshot = times.snapshot()
    assert snapshot["steps"] == 3
    step = snapshot["segments"]["step"]
    assert (step["count"], step["sum"]) == (3, pytest.approx(20.03))
    buckets = dict((str(bound), count) for bound, count in step["buckets"])
    assert buckets["0.01"] == 1 and buckets["0.025"] == 2 and buckets["10.0"] == 2
    assert buckets["+Inf"] == 3 and len(step["buckets"]) == len(STEP_BUCKETS) + 1
    assert snapshot["segments"]["all_sum"]["buckets"][0] == [STEP_BUCKETS[0], 1]


def test_decode_steps_of_one_sequence_are_summed_apart_as_a_one_stream_token() -> None:
    times = StepTimes()
    times.observe({"stage0": 0.010, "transit": 0.001}, [7], decode=True)
    times.observe({"stage0": 0.030, "transit": 0.002}, [7, 8], decode=True)  # a batch
    times.observe({"stage0": 0.500, "transit": 0.002}, [9])  # a prompt's chunk
    times.observe({"stage0": 0.014, "transit": 0.003}, iter([8]), decode=True)
    one_row = times.snapshot()["one_row"]
    assert one_row["stage0"] == {"count": 2, "sum": pytest.approx(0.024)}
    assert one_row["transit"] == {"count": 2, "sum": pytest.approx(0.004)}
    assert one_stream_segments_ms(times.snapshot()) == pytest.approx(
        {"stage0": 12.0, "transit": 2.0}
    )
    assert one_stream_segments_ms(None) == {} == one_stream_segments_ms(StepTimes().snapshot())


def test_a_tp_step_splits_into_all_sum_and_compute() -> None:
    segments = step_segments({"all_sum": 0.004, "step": 0.01}, 0.012)
    assert segments == pytest.approx(
        {"all_sum": 0.004, "compute": 0.006, "step": 0.01, "exchange": 0.012}
    )
    assert step_segments(None, 0.5) == {"exchange": 0.5}  # a worker that sends no timing


class CountingChannel:
    """What FrameClock reads of a SecureChannel: its sealing counters."""

    def __init__(self) -> None:
        self.seal_seconds = 0.0
        self.open_seconds = 0.0


def test_a_pipeline_answer_is_split_by_the_growth_of_the_stage_totals() -> None:
    outbound, inbound = CountingChannel(), CountingChannel()
    clock = FrameClock(outbound, inbound)
    clock.sent(1, stage_zero_s=0.003)
    time.sleep(0.05)
    outbound.seal_seconds, inbound.open_seconds = 0.001, 0.0005
    first = clock.answered(1, ((20_000, 1_000), (10_000, 500)))
    assert first["stage0"] == 0.003
    assert (first["stage1"], first["stage2"]) == pytest.approx((0.02, 0.01))
    assert first["seal"] == pytest.approx(0.001 + 0.0005 + 0.001 + 0.0005)
    assert first["round_trip"] >= 0.05
    assert first["transit"] == pytest.approx(first["round_trip"] - 0.0315)
    clock.sent(2, stage_zero_s=0.002)
    second = clock.answered(2, ((25_000, 1_200), (18_000, 600)))  # totals grew by this frame
    assert (second["stage1"], second["stage2"]) == pytest.approx((0.005, 0.008))
    assert second["seal"] == pytest.approx(0.0003)
    assert second["transit"] == 0.0  # the stages claim more than the round trip: never < 0


def test_a_stage_meter_reports_microseconds_of_its_session() -> None:
    inbound, outbound = CountingChannel(), CountingChannel()
    meter = StageMeter(inbound, outbound)
    meter.compute_s += 0.0125
    inbound.open_seconds, outbound.seal_seconds = 0.001, 0.002
    assert meter.entry() == (12_500, 3_000)
