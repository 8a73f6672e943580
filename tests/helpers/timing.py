"""Send requests to a real engine through the API; what its step timing shows in /metrics and
in the request records (the tp and pp tests share this)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.core.runner import EngineRunner
from engines.observability.request_timing import RequestRecord
from tests.helpers.api import MODEL_ID, make_service, open_client

PROMPTS = ("Hello there", "Once upon a time, in a land far away, there lived")
MODEL = f"model={MODEL_ID}"  # the label every model's series carry, in Flow's keys


@dataclass
class Flow:
    before: dict[str, float]
    after: dict[str, float]
    records: list[RequestRecord]
    after_text: str  # the second scrape as served

    def delta(self, key: str) -> float:
        return self.after.get(key, 0.0) - self.before.get(key, 0.0)

    def step_count(self, segment: str) -> float:
        return self.delta(f"tandem_engine_step_seconds_count{{{MODEL},segment={segment}}}")

    def step_sum(self, segment: str) -> float:
        return self.delta(f"tandem_engine_step_seconds_sum{{{MODEL},segment={segment}}}")


def _samples(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


def flow(runner: EngineRunner, max_tokens: int = 8) -> Flow:
    """Scrape, send PROMPTS at once (one batch) as completions, scrape again."""
    service = make_service(runner)
    records: list[RequestRecord] = []
    service.request_listeners.append(records.append)

    async def run() -> Flow:
        async with open_client(service) as client:
            before = _samples((await client.get("/metrics")).text)
            bodies = [
                {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
                for prompt in PROMPTS
            ]
            answers = await asyncio.gather(
                *(client.post("/v1/completions", json=body) for body in bodies)
            )
            assert [answer.status_code for answer in answers] == [200] * len(PROMPTS)
            text = (await client.get("/metrics")).text
        return Flow(before, _samples(text), records, text)

    return asyncio.run(asyncio.wait_for(run(), 120))


def check_request_shares(result: Flow, segments: tuple[str, ...]) -> None:
    """Every request carries each segment, inside its own prefill + decode, and /metrics
    counted one observation per request and segment."""
    assert len(result.records) == len(PROMPTS)
    for record in result.records:
        shares = dict(record.engine_s)
        assert set(segments) <= set(shares), shares
        assert all(value >= 0 for value in shares.values()), shares
        assert record.to_dict()["engine_s"] == pytest.approx(shares, abs=1e-6)
        for segment in segments:
            assert shares[segment] <= record.prefill_s + record.decode_s, (segment, record)
    for segment in segments:
        key = f"tandem_request_engine_seconds_count{{{MODEL},segment={segment}}}"
        assert result.delta(key) == len(PROMPTS), segment
