"""What a tensor-parallel group reports: every rank in its info, and step timing in /metrics
and the request records."""

from __future__ import annotations

import pytest

from cli.status import engine_steps, parse_metrics
from tests.helpers.timing import MODEL, check_request_shares, flow

pytestmark = pytest.mark.cluster


def test_info_describes_every_rank(cluster):
    info = cluster.engine.info()
    assert (info.strategy, info.world_size, info.detail["backend"]) == ("tp", 2, "ring")
    assert [rank["rank"] for rank in info.detail["ranks"]] == [0, 1]
    assert all(rank["peak_memory_bytes"] > 0 for rank in info.detail["ranks"])
    assert all(rank["address"].startswith("127.0.0.1:") for rank in info.detail["ranks"])


def test_step_timing_moves_in_metrics_and_request_records(tp_runner):
    """Requests through the API: rank 0's all_sum and step times reach /metrics and every
    request's record; the parts of a step fit inside the coordinator's round trip."""
    result = flow(tp_runner)
    steps = result.delta(f"tandem_engine_steps_total{{{MODEL}}}")
    assert steps >= 8  # 8 tokens each, one batch
    for segment in ("all_sum", "compute", "step", "exchange"):
        assert result.step_count(segment) == steps, segment
    assert result.step_sum("all_sum") > 0 and result.step_sum("compute") > 0
    assert result.step_sum("all_sum") + result.step_sum("compute") == pytest.approx(
        result.step_sum("step"), abs=1e-4
    )
    assert result.step_sum("step") <= result.step_sum("exchange")
    check_request_shares(result, ("all_sum", "compute", "step", "exchange"))
    status = engine_steps(parse_metrics(result.after_text))  # `tandem status`'s steps line
    assert "all_sum " in status and "exchange " in status
    detail = tp_runner.engine.info().detail["step_timing"]
    assert detail["segments"]["all_sum"]["buckets"][-1] == ["+Inf", detail["steps"]]
