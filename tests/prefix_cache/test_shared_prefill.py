"""Requests that share a long prefix with a prompt still being prefilled wait for its KV."""

from __future__ import annotations

import time
from pathlib import Path

from engines.core.engine_options import EngineOptions
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.prefix_cache.shared_prefill import PrefillSharing
from engines.single.engine import SingleEngine
from tests.helpers.engine import run_all

LOAD_TIMEOUT_S = 120
SYSTEM = "You are a careful assistant. Answer in full sentences and cite what you use. " * 14

# -- the books ------------------------------------------------------------------------------


def test_a_request_waits_for_the_longest_prompt_being_prefilled():
    sharing = PrefillSharing(min_shared_tokens=4)
    sharing.prefilling(1, (1, 2, 3, 4, 5, 6, 7, 8))
    sharing.prefilling(2, (1, 2, 3, 9, 9, 9, 9, 9))
    assert sharing.owner_for((1, 2, 3, 4, 5, 6, 0, 0), covered=0) == 1
    assert sharing.owner_for((1, 2, 3, 4, 5, 6, 0, 0), covered=3) is None  # too little to gain
    assert sharing.owner_for((7, 7, 7, 7, 7, 7), covered=0) is None
    sharing.wait(3, "request 3", owner=1)
    assert 3 in sharing and sharing.released() == []
    assert not sharing.first_token(2)  # done, but nobody waits for it
    assert sharing.first_token(1)
    assert sharing.released({1}) == [(3, "request 3")] and 3 not in sharing


def test_a_waiter_goes_in_when_its_owner_leaves_or_it_waited_long_enough():
    sharing = PrefillSharing(min_shared_tokens=2, max_wait_s=0.05)
    sharing.prefilling(1, (1, 2, 3, 4))
    sharing.prefilling(2, (5, 6, 7, 8))
    sharing.wait(10, "a", owner=1)
    sharing.wait(11, "b", owner=2)
    sharing.forget([1])  # cancelled before its prompt was done
    assert sharing.released() == [(10, "a")]
    time.sleep(0.06)
    assert sharing.released() == [(11, "b")]
    assert sharing.shared == 2


# -- the single engine ------------------------------------------------------------------------


def conversations(engine: SingleEngine, count: int) -> list[GenerationRequest]:
    tokenizer = engine.tokenizer
    return [
        GenerationRequest(f"user-{n}", tuple(tokenizer.encode(f"{SYSTEM} User {n}: hi?")), 10)
        for n in range(count)
    ]


def test_eight_users_with_one_system_prompt_prefill_it_once_and_answer_exactly(
    demo_model_dir: Path,
):
    runner = EngineRunner(
        SingleEngine(demo_model_dir, EngineOptions(prefix_cache_bytes=1 << 28)), max_batch=8
    )
    runner.start(LOAD_TIMEOUT_S)
    try:
        requests = conversations(runner.engine, 8)
        shared = run_all(runner, requests)
        snapshot = runner.engine.info().detail["prefix_cache"]
    finally:
        runner.close()
    cold_runner = EngineRunner(SingleEngine(demo_model_dir), max_batch=8)
    cold_runner.start(LOAD_TIMEOUT_S)
    try:
        cold = run_all(cold_runner, requests)
    finally:
        cold_runner.close()
    prompt = len(requests[0].prompt_tokens)
    computed = sum(len(r.prompt_tokens) for r in requests) - sum(o.cached_tokens for o in shared)
    assert computed <= 2 * prompt, (computed, prompt)  # not 8 prompts' worth
    assert snapshot["shared_prefills"] == 7
    assert sorted(o.cached_tokens > prompt // 2 for o in shared) == [False] + [True] * 7
    assert [o.tokens for o in shared] == [o.tokens for o in cold]
