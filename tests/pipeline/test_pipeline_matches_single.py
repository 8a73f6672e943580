"""The sealed pipeline gives SingleEngine's tokens: greedy and seeded, a prompt chunked or
not, penalties and logprobs, and exact again after a cancel."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from tests.helpers.pipeline import (
    LONG_PROMPT,
    PROMPTS,
    Pipeline,
    assert_same,
    make_request,
    run,
    status,
)

pytestmark = pytest.mark.cluster

# -- the same tokens as SingleEngine -------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_matches_single_engine(pipeline: Pipeline, prompt: str) -> None:
    outcome = assert_same(pipeline, make_request(pipeline.runner, prompt))
    assert outcome.completion_tokens > 0


@pytest.mark.parametrize(
    ("chunks", "extra"), [(0, 1), (2, 0), (2, 1)], ids=["one-token", "whole-chunks", "and-one"]
)
def test_the_last_chunk_samples_the_first_token_at_any_length(
    three_stages: Pipeline, chunks: int, extra: int
) -> None:
    """A prompt's last prefill chunk, whatever its length (one token, a whole chunk, one token
    after whole chunks), samples the first token: the single engine's tokens."""
    length = chunks * three_stages.engine.options.prefill_chunk + extra
    tokens = tuple(three_stages.engine.tokenizer.encode(LONG_PROMPT))[:length]
    assert len(tokens) == length
    assert_same(three_stages, GenerationRequest(f"edge-{length}", tokens, max_tokens=16))


def test_long_prompt_is_chunked_and_matches(pipeline: Pipeline) -> None:
    request = make_request(pipeline.runner, LONG_PROMPT, max_tokens=32)
    assert len(request.prompt_tokens) > pipeline.engine.options.prefill_chunk + 1
    assert_same(pipeline, request)


@pytest.mark.parametrize(("temperature", "top_p", "seed"), [(1.0, 1.0, 1234), (0.8, 0.9, 7)])
def test_seeded_sampling_matches_single_engine(
    pipeline: Pipeline, temperature: float, top_p: float, seed: int
) -> None:
    request = make_request(
        pipeline.runner, PROMPTS[2], temperature=temperature, top_p=top_p, seed=seed
    )
    outcome = assert_same(pipeline, request)
    greedy = run(pipeline.reference, make_request(pipeline.runner, PROMPTS[2]))
    assert outcome.tokens != greedy.tokens  # sampling really happened


def scored_events(runner: EngineRunner, request: GenerationRequest) -> list[Any]:
    async def collect() -> list[Any]:
        events = [event async for event in runner.submit(request).events()]
        return [event for event in events if event.token is not None]

    return asyncio.run(asyncio.wait_for(collect(), 60))


def test_penalties_and_logprobs_match_single_engine(pipeline: Pipeline) -> None:
    """Penalties run at the last stage on the raw logits, logprobs travel in TOKEN frames."""
    options = {"repetition_penalty": 1.3, "frequency_penalty": 1.5, "presence_penalty": 0.5}
    request = make_request(pipeline.runner, PROMPTS[0], max_tokens=24, logprobs=3, **options)
    expected = scored_events(pipeline.reference, request)
    got = scored_events(pipeline.runner, request)
    assert [event.token for event in got] == [event.token for event in expected]
    assert [event.logprob for event in got] == pytest.approx(
        [event.logprob for event in expected], abs=1e-4
    )
    assert [[t for t, _ in e.top_logprobs] for e in got] == [
        [t for t, _ in e.top_logprobs] for e in expected
    ]
    assert all(len(event.top_logprobs) == 3 for event in got)
    plain = scored_events(pipeline.runner, make_request(pipeline.runner, PROMPTS[0], 24))
    assert all(event.logprob is None for event in plain)


def test_cancel_frees_every_stage_and_the_next_request_is_exact(pipeline: Pipeline) -> None:
    before = status(pipeline)
    request = make_request(pipeline.runner, PROMPTS[0], max_tokens=500)
    cancelled = run(pipeline.runner, request, cancel_after=5)
    assert cancelled.finish == "cancelled"
    assert 5 <= len(cancelled.tokens) < 500
    after = status(pipeline)
    assert [report["layers"] for report in after] == [[r.start, r.stop] for r in pipeline.ranges]
    assert all(report["active_requests"] == 0 for report in after)
    assert [r["served_requests"] for r in after[1:]] == [
        r["served_requests"] + 1 for r in before[1:]
    ]
    assert_same(pipeline, make_request(pipeline.runner, PROMPTS[1]))


def test_a_relay_holds_no_layer_here_and_reports_the_single_it_serves(relay: Pipeline) -> None:
    """planner/relay.py's engine: stage 0 embeds only, the worker runs all four layers."""
    assert_same(relay, make_request(relay.runner, PROMPTS[1]))
    info = relay.engine.info()
    assert (info.strategy, info.world_size) == ("single", 2)
    assert [report["layers"] for report in status(relay)] == [[0, 0], [0, 4]]
    # the weights held here: the embedding alone (1024 x 256 float32 in the demo model)
    assert relay.engine.memory_held() == {"weights": 1024 * 256 * 4}
