"""A running pipeline session: its info and per-frame timing, a reconnect, and refusals (a
wrong cluster key, out-of-range sampling) that leave it serving."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cli.status import engine_steps, parse_metrics
from discovery.cluster_key import generate_key
from engines.api.dashboard_view import render_requests
from errors import EngineError
from tests.helpers.pipeline import (
    PROMPTS,
    Pipeline,
    assert_same,
    make_engine,
    make_request,
    run,
    status,
)
from tests.helpers.timing import MODEL, check_request_shares, flow

pytestmark = pytest.mark.cluster

# -- info and frame timing ------------------------------------------------------------------------


def test_info_describes_every_stage(three_stages: Pipeline) -> None:
    info = three_stages.engine.info()
    assert (info.strategy, info.world_size) == ("pp", 3)
    assert info.detail["micro_batches"] == 3
    stages = info.detail["stages"]
    assert [stage["layers"] for stage in stages] == [[0, 3], [3, 4], [4, 5]]
    assert all(stage["peak_memory_bytes"] > 0 for stage in stages)
    workers = three_stages.workers
    assert [stage["peak_memory_bytes"] for stage in stages[1:]] == [
        worker.peak_memory_bytes for worker in workers
    ]
    assert three_stages.engine.healthy()


def test_frame_timing_moves_in_metrics_and_request_records(three_stages: Pipeline) -> None:
    """Requests through the API: every answered frame is split into the coordinator's layers,
    each remote stage's, sealing and transit; /metrics and the request records show them."""
    result = flow(three_stages.runner)
    frames = result.delta(f"tandem_engine_steps_total{{{MODEL}}}")
    assert frames >= 8  # 8 tokens each, and the prefill chunks
    segments = ("stage0", "stage1", "stage2", "seal", "transit", "round_trip")
    for segment in segments:
        assert result.step_count(segment) == frames, segment
    for segment in ("stage0", "stage1", "stage2", "seal", "round_trip"):
        assert result.step_sum(segment) > 0, segment
    # each round trip holds its remote stages' work, less what the deltas over-count
    remote = result.step_sum("stage1") + result.step_sum("stage2")
    assert remote < result.step_sum("round_trip")
    # stage 0 runs on the scheduler thread, one frame after the other: inside the request's
    # own time (a request's frames may be in flight together, so its round trips may not be)
    check_request_shares(result, ("stage0",))
    assert all(set(segments) <= {name for name, _ in r.engine_s} for r in result.records)
    assert "stage2 " in render_requests(result.records)  # the dashboard's request rows
    assert "seal " in engine_steps(parse_metrics(result.after_text))  # `tandem status`


# -- a reconnect, and refusals that leave the session serving -------------------------------------


def test_reconnect_builds_a_fresh_session(three_stages: Pipeline) -> None:
    served = [report["served_requests"] for report in status(three_stages)[1:]]
    three_stages.engine.connect()  # new handshakes, new session keys, frame numbers from 1
    assert [report["served_requests"] for report in status(three_stages)[1:]] == served
    assert_same(three_stages, make_request(three_stages.runner, PROMPTS[3]))


def test_wrong_cluster_key_is_refused_and_the_session_survives(
    two_stages: Pipeline, demo_model_dir: Path
) -> None:
    ranges = two_stages.ranges
    engine = make_engine(demo_model_dir, ranges, generate_key(), None, two_stages.workers)
    started = time.monotonic()
    try:
        with pytest.raises(EngineError, match="prove the cluster key|handshake"):
            engine.load()
    finally:
        engine.close()
    assert time.monotonic() - started < 10
    assert two_stages.engine.healthy()
    assert_same(two_stages, make_request(two_stages.runner, PROMPTS[1], max_tokens=16))


def test_out_of_range_sampling_is_refused_before_the_chain(two_stages: Pipeline) -> None:
    refused = run(two_stages.runner, make_request(two_stages.runner, PROMPTS[0], temperature=-1.0))
    reason = "temperature must be a number in [0, 2], got -1.0"  # GenerationRequest.check
    assert refused.finish == "error" and reason in (refused.error or ""), refused.error
    assert two_stages.engine.healthy()
    assert_same(two_stages, make_request(two_stages.runner, PROMPTS[0], max_tokens=8))
