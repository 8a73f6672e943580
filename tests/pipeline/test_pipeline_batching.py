"""Batches through the pipeline: each request gets the tokens it gets alone, ends its own way,
and a newcomer's long prefill does not freeze the running streams."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.helpers.pipeline import (
    LONG_PROMPT,
    PROMPTS,
    Outcome,
    Pipeline,
    assert_same,
    collect,
    make_request,
    run,
    run_all,
    status,
)

pytestmark = pytest.mark.cluster

# -- batches -------------------------------------------------------------------------------------

BATCH_PROMPTS = (*PROMPTS, "A", "Why not", LONG_PROMPT[:200], "tell me a story about a cat")


def test_greedy_batch_matches_single_engine_alone(pipeline: Pipeline) -> None:
    """Eight greedy requests at once: each gets the tokens SingleEngine gives it alone."""
    requests = [
        make_request(pipeline.runner, prompt, max_tokens=24 + 5 * index)
        for index, prompt in enumerate(BATCH_PROMPTS)
    ]
    alone = [run(pipeline.reference, request) for request in requests]
    together = run_all(pipeline.runner, requests)
    assert [outcome.tokens for outcome in together] == [outcome.tokens for outcome in alone]
    assert [outcome.finish for outcome in together] == [outcome.finish for outcome in alone]
    assert status(pipeline)[1]["active_requests"] == 0


def test_burst_of_eight_ends_every_request_correctly(pipeline: Pipeline) -> None:
    """Different lengths, stops and temperatures, one cancelled, one timing out, all at once."""
    runner = pipeline.runner
    stopper = make_request(runner, PROMPTS[2], max_tokens=64)
    stop_word = run(pipeline.reference, stopper).text.split()[3]
    requests = [
        make_request(runner, PROMPTS[0], max_tokens=48),
        make_request(runner, PROMPTS[1], max_tokens=3),
        make_request(runner, PROMPTS[2], max_tokens=40, temperature=1.0, seed=1234),
        make_request(runner, PROMPTS[3], max_tokens=30, temperature=0.8, top_p=0.9, seed=7),
        make_request(runner, PROMPTS[2], max_tokens=64, stop=(stop_word,)),
        make_request(runner, LONG_PROMPT, max_tokens=20),
        make_request(runner, PROMPTS[1], max_tokens=500),  # cancelled after 4 tokens
        make_request(runner, PROMPTS[0], max_tokens=100_000, timeout_s=2.0),
    ]
    expected = [run(pipeline.reference, request) for request in requests[:6]]
    outcomes = run_all(runner, requests, cancel_after={6: 4})
    for got, want in zip(outcomes[:6], expected, strict=True):
        assert (got.tokens, got.text, got.finish) == (want.tokens, want.text, want.finish)
        assert got.completion_tokens == want.completion_tokens
    assert outcomes[1].completion_tokens == 3 and outcomes[1].finish == "length"
    assert outcomes[4].finish == "stop" and stop_word not in outcomes[4].text
    greedy = run(pipeline.reference, make_request(runner, PROMPTS[1], max_tokens=100)).tokens
    cancelled, timed_out = outcomes[6], outcomes[7]
    assert cancelled.finish == "cancelled" and 4 <= len(cancelled.tokens) < 500
    assert cancelled.tokens == greedy[: len(cancelled.tokens)]
    assert cancelled.completion_tokens == len(cancelled.tokens)
    assert timed_out.finish == "error" and "timed out after 2 s" in (timed_out.error or "")
    assert timed_out.completion_tokens == len(timed_out.tokens) > 0
    assert all(report["active_requests"] == 0 for report in status(pipeline))
    assert_same(pipeline, make_request(runner, PROMPTS[3], max_tokens=16))


def test_long_prefill_does_not_freeze_running_streams(three_stages: Pipeline) -> None:
    """A newcomer's long prompt is prefilled a chunk per step between the others' tokens."""
    runner = three_stages.runner
    running = make_request(runner, PROMPTS[0], max_tokens=1000)
    newcomer = make_request(runner, LONG_PROMPT * 2, max_tokens=1)
    chunks = len(newcomer.prompt_tokens) // three_stages.engine.options.prefill_chunk
    assert chunks >= 10
    stamps: list[float] = []
    warm = asyncio.Event()

    async def keep_streaming() -> Outcome:
        submission = runner.submit(running)
        async for event in submission.events():
            stamps.append(time.monotonic())
            if len(stamps) == 5:
                warm.set()
            if event.finish_reason is not None:
                return Outcome([], "", event.finish_reason, event.error, event.completion_tokens)
        raise AssertionError("no final event")

    async def arrive_late(stream: asyncio.Task) -> tuple[float, float, Outcome]:
        await warm.wait()
        submitted = time.monotonic()
        outcome = await collect(runner, newcomer)
        answered = time.monotonic()
        for submission in runner.running():
            submission.cancel()
        await stream
        return submitted, answered, outcome

    async def race() -> tuple[float, float, Outcome]:
        stream = asyncio.ensure_future(keep_streaming())
        return await arrive_late(stream)

    submitted, answered, late = asyncio.run(asyncio.wait_for(race(), timeout=60))
    assert late.finish == "length"
    during = [stamp for stamp in stamps if submitted < stamp < answered]
    assert len(during) >= chunks // 2, (len(during), chunks)
