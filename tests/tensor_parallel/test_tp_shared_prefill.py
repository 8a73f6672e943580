"""Shared prefill on tp: requests that share a long prefix with a prompt still being prefilled
wait for it, every rank keeps that prompt's KV shard as an entry, and they start from it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from tests.helpers.engine import run_all
from tests.helpers.tensor_parallel import LOAD_TIMEOUT_S, close_cluster, open_cluster

SYSTEM = "You are a careful assistant. Answer in full sentences and cite what you use. " * 14


@pytest.fixture(scope="module")
def sharing_runner(demo_model_dir: Path) -> Iterator[EngineRunner]:
    """A tp=2 group with a prefix cache (the package's `tp_runner` has none)."""
    cluster = open_cluster(demo_model_dir, spec_options={"prefix_cache_bytes": 1 << 28})
    runner = EngineRunner(cluster.engine, max_batch=8)
    try:
        runner.start(LOAD_TIMEOUT_S)
        yield runner
    finally:
        runner.close()
        close_cluster(cluster)


def test_eight_shared_prefix_first_turns_prefill_it_once_and_answer_as_without_sharing(
    sharing_runner: EngineRunner, tp_runner: EngineRunner
):
    tokenizer = sharing_runner.engine.tokenizer
    requests = [
        GenerationRequest(f"user-{n}", tuple(tokenizer.encode(f"{SYSTEM} User {n}: hi?")), 10)
        for n in range(8)
    ]
    prompt = len(requests[0].prompt_tokens)
    unshared_before = tp_runner.engine.prefilled_tokens
    unshared = run_all(tp_runner, requests)
    unshared_prefilled = tp_runner.engine.prefilled_tokens - unshared_before
    shared = run_all(sharing_runner, requests)
    engine = sharing_runner.engine
    prefilled = engine.info().detail["prefilled_tokens"]  # what the ranks ran, as they report
    assert unshared_prefilled == sum(len(r.prompt_tokens) for r in requests)  # 8 prompts' worth
    assert prefilled <= 2 * prompt, (prefilled, prompt)
    assert engine.info().detail["prefix_cache"]["shared_prefills"] == 7
    assert sorted(o.cached_tokens > prompt // 2 for o in shared) == [False] + [True] * 7
    assert [o.tokens for o in shared] == [o.tokens for o in unshared]
    assert all(len(o.tokens) == 10 for o in shared)
