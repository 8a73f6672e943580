"""Tensor parallel on a shared two-rank ring group over 127.0.0.1 gives SingleEngine's tokens:
greedy, seeded, penalised, stopped early, queued, refused, and batched."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from tests.helpers.engine import make_request, run_all, run_one
from tests.helpers.tensor_parallel import PROMPTS

pytestmark = pytest.mark.cluster

# -- the shared two-rank cluster -----------------------------------------------------------


def test_greedy_output_equals_single_token_for_token(tp_runner, single_runner):
    for prompt in PROMPTS:
        expected = run_one(single_runner, make_request(single_runner.engine, prompt, 64))
        got = run_one(tp_runner, make_request(tp_runner.engine, prompt, 64))
        assert got.tokens == expected.tokens, prompt
        assert (got.text, got.finish) == (expected.text, expected.finish)
        assert len(got.tokens) >= 16  # the comparison means something
        assert got.events >= len(got.tokens) + 1  # streamed one event per token, then the end


def test_seeded_sampling_equals_single(tp_runner, single_runner):
    for seed in (7, 1234):
        options = {"temperature": 1.0, "top_p": 0.9, "seed": seed}
        expected = run_one(
            single_runner, make_request(single_runner.engine, PROMPTS[0], 32, **options)
        )
        got = run_one(tp_runner, make_request(tp_runner.engine, PROMPTS[0], 32, **options))
        assert got.tokens == expected.tokens
    greedy = run_one(single_runner, make_request(single_runner.engine, PROMPTS[0], 32))
    assert got.tokens != greedy.tokens  # sampling really sampled


def test_early_stops_leave_every_rank_ready_for_the_next_request(tp_runner, single_runner):
    full = run_one(single_runner, make_request(single_runner.engine, PROMPTS[1], 64))
    assert len(full.tokens) >= 40

    short = run_one(tp_runner, make_request(tp_runner.engine, PROMPTS[1], 3))
    assert (short.tokens, short.finish) == (full.tokens[:3], "length")

    # A stop string that first appears around the 20th token: the runner stops mid-sync-window.
    position = len(tp_runner.engine.tokenizer.decode(full.tokens[:20]))
    stop = full.text[position : position + 3]
    expected = run_one(
        single_runner, make_request(single_runner.engine, PROMPTS[1], 64, stop=(stop,))
    )
    stopped = run_one(tp_runner, make_request(tp_runner.engine, PROMPTS[1], 64, stop=(stop,)))
    assert stopped.finish == expected.finish == "stop"
    assert stopped.text == expected.text == full.text[: full.text.find(stop)]

    cancelled = run_one(
        tp_runner, make_request(tp_runner.engine, PROMPTS[1], 5_000), cancel_after=5
    )
    assert cancelled.finish == "cancelled"
    assert cancelled.tokens[:5] == full.tokens[:5]

    after = run_one(tp_runner, make_request(tp_runner.engine, PROMPTS[1], 64))
    assert after.tokens == full.tokens


def test_queued_requests_are_all_answered_correctly(tp_runner, single_runner):
    specs = [
        (PROMPTS[0], 24, {}),
        (PROMPTS[1], 16, {"temperature": 1.0, "seed": 5}),
        (PROMPTS[2], 24, {}),
        (PROMPTS[0], 8, {"temperature": 0.7, "top_p": 0.5, "seed": 9}),
    ]
    expected = [
        run_one(single_runner, make_request(single_runner.engine, p, n, **o)) for p, n, o in specs
    ]
    got = run_all(tp_runner, [make_request(tp_runner.engine, p, n, **o) for p, n, o in specs])
    assert [g.tokens for g in got] == [e.tokens for e in expected]
    assert all(g.finish in ("length", "stop") for g in got)


def test_penalties_and_logprobs_equal_single(tp_runner, single_runner):
    options = {"frequency_penalty": 1.5, "repetition_penalty": 1.2, "logprobs": 2}
    for runner_ in (single_runner, tp_runner):
        request = make_request(runner_.engine, PROMPTS[0], 24, **options)
        submission_events = run_events(runner_, request)
        tokens = [(e.token, e.top_logprobs and e.top_logprobs[0][0]) for e in submission_events]
        logprobs = [e.logprob for e in submission_events]
        if runner_ is single_runner:
            expected_tokens, expected_logprobs = tokens, logprobs
    assert tokens == expected_tokens
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)
    assert all(value is not None for value in logprobs)


def run_events(runner: EngineRunner, request: GenerationRequest) -> list[Any]:
    async def collect() -> list[Any]:
        events = [event async for event in runner.submit(request).events()]
        return [event for event in events if event.token is not None]

    return asyncio.run(asyncio.wait_for(collect(), 60))


def test_a_refused_request_keeps_the_group(tp_runner, single_runner):
    refused = run_one(tp_runner, GenerationRequest("bad", (10**6,), 8))
    assert refused.finish == "error" and "token ids" in refused.error
    expected = run_one(single_runner, make_request(single_runner.engine, PROMPTS[2], 8))
    assert (
        run_one(tp_runner, make_request(tp_runner.engine, PROMPTS[2], 8)).tokens == expected.tokens
    )


def test_a_batch_of_eight_equals_each_request_alone(tp_runner, single_runner):
    """Mixed sampling, stop strings, a cancel and a timeout in one batch; greedy rows exact."""
    reference = run_one(single_runner, make_request(single_runner.engine, PROMPTS[1], 48))
    stop = reference.text[len(reference.text) // 2 :][:3]
    specs = [
        (PROMPTS[0], 40, {}),
        (PROMPTS[1], 48, {}),
        (PROMPTS[2], 12, {}),
        (PROMPTS[0], 24, {"temperature": 1.0, "top_p": 0.9, "seed": 3}),
        (PROMPTS[1], 48, {"stop": (stop,)}),
        (PROMPTS[2], 30, {"temperature": 0.7, "seed": 11}),
        (PROMPTS[1], 5_000, {}),  # cancelled after 4 tokens
        (PROMPTS[0], 100_000, {"timeout_s": 1.0}),
    ]
    requests = [make_request(tp_runner.engine, p, n, **o) for p, n, o in specs]
    alone = [run_one(single_runner, r) for r in requests[:6]]
    got = run_all(tp_runner, requests, cancel_after={6: 4})
    for index in range(6):
        assert got[index].tokens == alone[index].tokens, index
        assert (got[index].finish, got[index].text) == (alone[index].finish, alone[index].text)
        assert got[index].completion_tokens == len(got[index].tokens)
        assert got[index].prompt_tokens == len(requests[index].prompt_tokens)
    assert got[4].finish == "stop" and stop not in got[4].text
    assert got[6].finish == "cancelled" and got[6].tokens[:4] == reference.tokens[:4]
    assert got[7].finish == "error" and "timed out" in got[7].error
    after = run_one(tp_runner, make_request(tp_runner.engine, PROMPTS[1], 48))
    assert after.tokens == reference.tokens
