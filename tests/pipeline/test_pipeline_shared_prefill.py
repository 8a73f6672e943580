"""Shared prefill on 2 real stages: first turns that share one long system prompt, sent
together, wait for the first one's prompt and start from its KV on every stage; they prefill
about one prompt's worth between them and answer as a cold engine does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from discovery.cluster_key import generate_key
from engines.core.request import GenerationRequest
from engines.pipeline.engine import EncryptedPipelineEngine
from planner import allocate_layers
from tests.helpers.engine import run_all
from tests.helpers.pipeline import Pipeline, open_pipeline, status

pytestmark = pytest.mark.cluster

SYSTEM = "You are a careful assistant. Answer in full sentences and cite what you use. " * 14
USERS = 8


@pytest.fixture(scope="module")
def sharing(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    """The 4-layer demo model on 2 stages with a prefix cache, and a cold SingleEngine. 64-token
    chunks: the owner's prompt takes several frames, so the others find it prefilling."""
    yield from open_pipeline(
        demo_model_dir, allocate_layers(4, [8, 8]), generate_key(),
        tmp_path_factory.mktemp("shared-prefill"), prefill_chunk=64, prefix_cache_bytes=64 << 20,
    )  # fmt: skip


def first_turns(engine: EncryptedPipelineEngine, topic: str) -> list[GenerationRequest]:
    encode = engine.tokenizer.encode
    return [
        GenerationRequest(f"user-{n}", tuple(encode(f"{topic} {SYSTEM} User {n}: hi?")), 10)
        for n in range(USERS)
    ]


def prefilled_tokens(sharing: Pipeline) -> list[int]:
    """Prompt tokens every stage has run in prefill chunks this session, stage 0 first."""
    return [report["prefilled_tokens"] for report in status(sharing)]


def test_eight_first_turns_with_one_system_prompt_prefill_it_once(sharing: Pipeline) -> None:
    requests = first_turns(sharing.engine, "Shared:")
    before = prefilled_tokens(sharing)
    shared_before = sharing.engine.info().detail["prefix_cache"]["shared_prefills"]
    outcomes = run_all(sharing.runner, requests)
    computed = [after - then for after, then in zip(prefilled_tokens(sharing), before, strict=True)]
    prompt = len(requests[0].prompt_tokens)
    assert computed[0] == computed[1] <= 2 * prompt, (computed, prompt)  # not 8 prompts' worth
    assert computed[0] == sum(len(r.prompt_tokens) for r in requests) - sum(
        outcome.cached_tokens for outcome in outcomes
    )
    detail = sharing.engine.info().detail
    assert detail["prefilled_tokens"] == before[0] + computed[0]
    assert detail["prefix_cache"]["shared_prefills"] - shared_before == USERS - 1
    assert sorted(o.cached_tokens > prompt // 2 for o in outcomes) == [False] + [True] * 7
    cold = run_all(sharing.reference, requests)
    assert [(o.tokens, o.finish) for o in outcomes] == [(o.tokens, o.finish) for o in cold]


def test_without_a_long_common_prefix_nobody_waits(sharing: Pipeline) -> None:
    """Prompts that share less than 64 tokens each prefill their own (and answer exactly)."""
    encode = sharing.engine.tokenizer.encode
    requests = [
        GenerationRequest(f"solo-{n}", tuple(encode(f"Topic {n}: {SYSTEM[: 40 + n]}")), 6)
        for n in range(3)
    ]
    before = prefilled_tokens(sharing)[0]
    shared_before = sharing.engine.info().detail["prefix_cache"]["shared_prefills"]
    outcomes = run_all(sharing.runner, requests)
    assert prefilled_tokens(sharing)[0] - before == sum(len(r.prompt_tokens) for r in requests)
    assert sharing.engine.info().detail["prefix_cache"]["shared_prefills"] == shared_before
    assert [o.tokens for o in outcomes] == [o.tokens for o in run_all(sharing.reference, requests)]
