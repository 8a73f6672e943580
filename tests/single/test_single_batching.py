"""SingleEngine under continuous batching: a batch changes no result, every way to end works."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.single.engine import SingleEngine
from tests.helpers.engine import make_request, run_all, run_one

PROMPTS = ("The quick brown fox", "Once upon a time, in a city by the sea,", "def main():")
LOAD_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def runner(demo_model_dir: Path) -> Iterator[EngineRunner]:
    runner = EngineRunner(SingleEngine(demo_model_dir), queue_size=16, max_batch=8)
    runner.start(LOAD_TIMEOUT_S)
    yield runner
    runner.close()


def test_each_greedy_request_in_a_batch_of_8_equals_it_alone(runner):
    requests = [make_request(runner.engine, f"{PROMPTS[i % 3]} {i}", 20 + 4 * i) for i in range(8)]
    alone = [run_one(runner, request) for request in requests]
    together = run_all(runner, requests)
    assert [o.tokens for o in together] == [o.tokens for o in alone]
    assert [o.text for o in together] == [o.text for o in alone]
    assert all(len(o.tokens) >= 8 for o in alone)  # the comparison means something


def test_top_k_1_and_min_p_1_sample_the_greedy_tokens(runner):
    """top_k=1 (and min_p=1, which keeps only the most likely token) leave the sampler one
    choice at any temperature: the greedy one, so the filters really run."""
    greedy = run_one(runner, make_request(runner.engine, PROMPTS[1], 24))
    for options in ({"top_k": 1}, {"min_p": 1.0}):
        sampled = make_request(runner.engine, PROMPTS[1], 24, temperature=1.5, seed=3, **options)
        assert run_one(runner, sampled).tokens == greedy.tokens, options
    free = make_request(runner.engine, PROMPTS[1], 24, temperature=1.5, seed=3)
    assert run_one(runner, free).tokens != greedy.tokens  # without a filter it would differ


def test_a_burst_ends_every_way_with_the_right_usage(runner):
    reference = run_one(runner, make_request(runner.engine, PROMPTS[1], 48))
    stop = reference.text[len(reference.text) // 2 :][:3]
    specs = [
        (PROMPTS[0], 10, {}),
        (PROMPTS[1], 48, {"stop": (stop,)}),
        (PROMPTS[2], 30, {"temperature": 0.8, "top_p": 0.9, "seed": 1}),
        (PROMPTS[1], 5_000, {}),  # cancelled after 3 tokens
        (PROMPTS[0], 100_000, {"timeout_s": 0.5}),
        (PROMPTS[2], 1, {}),
    ]
    requests = [make_request(runner.engine, p, n, **o) for p, n, o in specs]
    got = run_all(runner, requests, cancel_after={3: 3})
    assert (got[0].finish, got[0].completion_tokens) == ("length", 10)
    assert got[1].finish == "stop" and stop not in got[1].text
    assert got[2].finish in ("length", "stop") and got[2].completion_tokens <= 30
    assert got[3].finish == "cancelled" and got[3].tokens[:3] == reference.tokens[:3]
    assert got[4].finish == "error" and "timed out after 0.5 s" in got[4].error
    assert (got[5].finish, got[5].completion_tokens) == ("length", 1)
    for outcome, request in zip(got, requests, strict=True):
        assert outcome.prompt_tokens == len(request.prompt_tokens)
        assert outcome.completion_tokens == len(outcome.tokens)
    assert run_one(runner, make_request(runner.engine, PROMPTS[1], 48)).tokens == reference.tokens


def test_a_seeded_request_is_reproducible_in_any_batch(runner):
    seeded = make_request(runner.engine, PROMPTS[0], 24, temperature=1.0, seed=42)
    alone = run_one(runner, seeded)
    crowd = [make_request(runner.engine, p, 24, temperature=1.0) for p in PROMPTS]
    together = run_all(runner, [*crowd, seeded])
    assert together[-1].tokens == alone.tokens
    greedy = run_one(runner, make_request(runner.engine, PROMPTS[0], 24))
    assert alone.tokens != greedy.tokens  # it really sampled


def test_logprobs_are_normalised_and_ranked(runner):
    request = make_request(runner.engine, PROMPTS[2], 12, logprobs=3)
    events = run_one_events(runner, request)
    tokens = [e for e in events if e.token is not None]
    assert len(tokens) == 12
    for event in tokens:
        assert event.logprob is not None and event.logprob <= 0
        assert len(event.top_logprobs) == 3
        values = [value for _, value in event.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-4
        assert event.logprob <= values[0] + 1e-6  # greedy picks the most likely
        assert event.top_logprobs[0][0] == event.token


def test_penalties_reduce_repetition(runner):
    plain = run_one(runner, make_request(runner.engine, PROMPTS[0], 64))
    penalised = run_one(runner, make_request(runner.engine, PROMPTS[0], 64, frequency_penalty=2.0))
    repeated = run_one(runner, make_request(runner.engine, PROMPTS[0], 64, repetition_penalty=1.5))

    def repeats(tokens: list[int]) -> int:
        return len(tokens) - len(set(tokens))

    assert repeats(penalised.tokens) < repeats(plain.tokens)
    assert repeats(repeated.tokens) < repeats(plain.tokens)


def run_one_events(runner: EngineRunner, request: GenerationRequest) -> list:
    import asyncio

    async def collect() -> list:
        return [event async for event in runner.submit(request).events()]

    return asyncio.run(asyncio.wait_for(collect(), 60))


def test_unseeded_requests_share_one_sampler_and_still_draw_apart(runner):
    """Requests without a seed sample in one batched call (one shared sampler), yet each row
    draws its own token; seeded and greedy ones keep their own."""
    samplers = runner.engine._samplers
    unseeded = [make_request(runner.engine, PROMPTS[1], 16, temperature=1.0) for _ in range(4)]
    assert len({id(samplers.for_request(request)) for request in unseeded}) == 1
    seeded = make_request(runner.engine, PROMPTS[1], 16, temperature=1.0, seed=3)
    assert samplers.for_request(seeded) is not samplers.for_request(unseeded[0])
    other = make_request(runner.engine, PROMPTS[1], 16, temperature=0.7)
    assert samplers.for_request(other) is not samplers.for_request(unseeded[0])
    together = run_all(runner, unseeded)
    assert len({tuple(outcome.tokens) for outcome in together}) > 1  # same prompt, own draws
