"""What speculation shows an operator per request: the dashboard's request row."""

from __future__ import annotations

from engines.api.dashboard_view import render_requests
from engines.observability.request_timing import RequestRecord


def record(drafted: int, accepted: int) -> RequestRecord:
    return RequestRecord(
        request_id="req-1", model="m", strategy="single", finish_reason="stop", error=None,
        prompt_tokens=20, completion_tokens=30, cached_tokens=0, started_at=0.0, parse_s=0.0,
        queue_s=0.0, prefill_s=0.1, decode_s=1.0, time_to_first_token_s=0.1,
        drafted_tokens=drafted, accepted_tokens=accepted,
    )  # fmt: skip


def test_a_request_row_says_how_many_drafts_were_accepted():
    assert "(17/24 drafts accepted)" in render_requests([record(24, 17)])
    assert "drafts accepted" not in render_requests([record(0, 0)])  # nothing drafted: quiet
    assert record(24, 17).to_dict()["accepted_tokens"] == 17  # the request log's line
