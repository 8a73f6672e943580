"""The prefix cache: the index alone, then single and tp engines reusing what they computed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.core.engine_options import EngineOptions
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.prefix_cache.index import PrefixHit, PrefixIndex
from engines.single.engine import SingleEngine
from engines.tensor_parallel.engine import TensorParallelEngine
from engines.tensor_parallel.group import loopback_ring_specs
from planner import Parallelism
from planner.cluster_plan import PREFIX_CACHE_SHARE, plan_cluster
from planner.plan_data import NodeResources
from tests.helpers.cluster import wait_until
from tests.helpers.engine import run_all, run_one
from tests.helpers.planning import SHAPE
from tests.helpers.tensor_parallel import GRAMMAR, start_rank, stop_processes

LOAD_TIMEOUT_S = 120
BUDGET = 1 << 28
SYSTEM = "You are a careful assistant. Answer in full sentences and cite what you use. " * 12

# -- the index ------------------------------------------------------------------------------


def test_the_longest_shared_prefix_wins_and_leaves_the_last_token_to_compute():
    index = PrefixIndex(1000)
    index.add(1, (1, 2, 3), 30)
    index.add(2, (1, 2, 9, 9, 9), 50)
    index.add(3, (7, 8), 20)
    assert index.lookup((1, 2, 3, 4)) == PrefixHit(1, 3)
    assert index.lookup((1, 2, 9, 9, 5)) == PrefixHit(2, 4)
    assert index.lookup((1, 2, 3)) == PrefixHit(1, 2)  # the last token still runs
    assert index.lookup((5, 5)) is None
    assert index.lookup((7,)) is None  # nothing can be reused from a one-token prompt
    assert index.snapshot()["hits"] == 3 and index.snapshot()["misses"] == 2


def test_two_branches_of_one_system_prompt_both_hit_and_the_entry_stays():
    index = PrefixIndex(1000)
    index.add(1, (1, 2, 3, 4), 40)
    assert index.lookup((1, 2, 3, 4, 5, 6)) == PrefixHit(1, 4)
    assert index.lookup((1, 2, 3, 7, 8)) == PrefixHit(1, 3)  # trimmed reuse of the same entry
    assert 1 in index and len(index) == 1


def test_a_kept_entry_replaces_its_own_prefixes_when_caches_trim():
    index = PrefixIndex(1000)
    index.add(1, (1, 2, 3), 30)
    assert index.add(2, (1, 2, 3, 4, 5), 50) == [1]
    assert 1 not in index and index.nbytes == 50
    untrimmable = PrefixIndex(1000, trimmable=False)
    untrimmable.add(1, (1, 2, 3), 30)
    assert untrimmable.add(2, (1, 2, 3, 4, 5), 50) == []
    assert untrimmable.lookup((1, 2, 3, 4, 9)) == PrefixHit(1, 3)  # whole entries only
    assert untrimmable.lookup((1, 2, 7)) is None


def test_least_recently_used_entries_go_first_past_the_byte_budget():
    index = PrefixIndex(100)
    index.add(1, (1,) * 4, 40)
    index.add(2, (2,) * 4, 40)
    index.lookup((1, 1, 1, 1, 5))  # entry 1 is now the most recent
    assert index.add(3, (3,) * 4, 40) == [2]
    assert sorted([1, 3]) == sorted(entry for entry in (1, 2, 3) if entry in index)
    assert index.add(4, (4,) * 20, 200) == [4]  # larger than the whole budget: not kept
    assert index.evict(0.5) == [1]
    assert index.evict(0.0) == [3] and index.nbytes == 0
    assert index.snapshot()["evictions"] == 3


def test_a_cache_of_zero_bytes_is_off():
    index = PrefixIndex(0)
    assert not index.enabled
    assert index.add(1, (1, 2, 3), 10) == [1]
    assert index.lookup((1, 2, 3, 4)) is None


# -- the planner's budget --------------------------------------------------------------------


def test_the_planner_counts_an_explicit_prefix_cache_in_every_nodes_need():
    nodes = [
        NodeResources("a", "127.0.0.1", 8 << 30, ()),
        NodeResources("b", "127.0.0.2", 8 << 30, ()),
    ]
    without = plan_cluster(Parallelism.PP, SHAPE, nodes, max_batch=2)
    with_cache = plan_cluster(Parallelism.PP, SHAPE, nodes, max_batch=2, prefix_cache_bytes=1 << 30)
    assert with_cache.prefix_cache_bytes == pytest.approx(1 << 30, rel=0.01)
    grown = [
        b.need_bytes - a.need_bytes for a, b in zip(without.fits, with_cache.fits, strict=True)
    ]
    assert all(extra >= (1 << 30) // 2 for extra in grown)  # half the layers each
    assert "prefix cache: 1.0 GB" in "\n".join(with_cache.describe())
    too_big = plan_cluster(Parallelism.PP, SHAPE, nodes, prefix_cache_bytes=64 << 30)
    assert too_big.refusal is not None


def test_auto_gives_the_prefix_cache_a_share_of_what_the_tightest_node_has_left():
    nodes = [
        NodeResources("a", "127.0.0.1", 2 << 30, ()),
        NodeResources("b", "127.0.0.2", 6 << 30, ()),
    ]
    plan = plan_cluster(Parallelism.PP, SHAPE, nodes, prefix_cache_bytes=None)
    assert plan.refusal is None and plan.prefix_cache_bytes > 0
    spare = [fit.available_bytes - fit.need_bytes for fit in plan.fits]
    assert all(room > 0 for room in spare)  # the cache fits inside what was left
    baseline = plan_cluster(Parallelism.PP, SHAPE, nodes)
    tightest = min(
        (fit.available_bytes - fit.need_bytes) / (len(stage.layers) / SHAPE.num_layers)
        for fit, stage in zip(baseline.fits, baseline.stages, strict=True)
    )
    assert plan.prefix_cache_bytes == pytest.approx(tightest * PREFIX_CACHE_SHARE, rel=0.01)


# -- engines -------------------------------------------------------------------------------


def conversation(tokenizer) -> tuple[tuple[int, ...], str]:
    return tuple(tokenizer.encode(SYSTEM + " Question one: what is a fox?")), " Question two?"


@pytest.fixture(scope="module")
def cold_runner(demo_model_dir: Path) -> Iterator[EngineRunner]:
    runner = EngineRunner(SingleEngine(demo_model_dir), max_batch=8)
    runner.start(LOAD_TIMEOUT_S)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def cached_runner(demo_model_dir: Path) -> Iterator[EngineRunner]:
    runner = EngineRunner(
        SingleEngine(demo_model_dir, EngineOptions(prefix_cache_bytes=BUDGET)), max_batch=8
    )
    runner.start(LOAD_TIMEOUT_S)
    yield runner
    runner.close()


def follow_up(runner: EngineRunner, first: tuple[int, ...], answer: list[int], text: str):
    return first + tuple(answer) + tuple(runner.engine.tokenizer.encode(text))


def test_single_a_second_turn_reuses_the_first_and_matches_a_cold_engine(
    cached_runner, cold_runner
):
    first, question = conversation(cached_runner.engine.tokenizer)
    turn_one = run_one(cached_runner, GenerationRequest("t1", first, 16))
    assert turn_one.cached_tokens == 0
    second = follow_up(cached_runner, first, turn_one.tokens, question)
    turn_two = run_one(cached_runner, GenerationRequest("t2", second, 16))
    cold = run_one(cold_runner, GenerationRequest("c2", second, 16))
    assert turn_two.cached_tokens >= len(first)  # the whole first turn, answer included
    assert turn_two.cached_tokens < len(second)
    assert turn_two.tokens == cold.tokens and len(cold.tokens) == 16


def test_single_branches_hit_in_one_batch_and_stay_exact(cached_runner, cold_runner):
    shared = tuple(cached_runner.engine.tokenizer.encode(SYSTEM + " Branching now."))
    run_one(cached_runner, GenerationRequest("root", shared, 4))
    branches = [
        GenerationRequest(f"b{i}", shared + tuple(cached_runner.engine.tokenizer.encode(tail)), 12)
        for i, tail in enumerate([" left", " right", " middle way", " elsewhere"])
    ]
    hot = run_all(cached_runner, branches)
    cold = run_all(cold_runner, branches)
    assert all(outcome.cached_tokens >= len(shared) - 1 for outcome in hot)
    assert [o.tokens for o in hot] == [o.tokens for o in cold]


def test_single_a_hit_samples_its_first_token_like_a_cold_engine(cached_runner, cold_runner):
    """A hit computes its rest and first token in one pass (prefix_cache/cached_prefill.py):
    every per-request option must act on that token as the batch generator would."""
    tokenizer = cached_runner.engine.tokenizer
    shared = tuple(tokenizer.encode(SYSTEM + " Options follow."))
    run_one(cached_runner, GenerationRequest("options-root", shared, 2))

    def ask(tail: str, max_tokens: int, **options) -> GenerationRequest:
        prompt = shared + tuple(tokenizer.encode(tail))
        return GenerationRequest(f"opt-{tail}", prompt, max_tokens, **options)

    requests = [
        ask(" seeded", 8, temperature=0.9, top_p=0.8, seed=7),
        ask(" penalised", 8, repetition_penalty=1.5, presence_penalty=0.5),
        ask(" scored", 6, logprobs=3),
        ask(" as json", 12, grammar=GRAMMAR),
        ask(" one token", 1),
    ]
    hot = [run_one(cached_runner, request) for request in requests]
    cold = [run_one(cold_runner, request) for request in requests]
    assert all(outcome.cached_tokens >= len(shared) - 1 for outcome in hot)
    assert [o.tokens for o in hot] == [o.tokens for o in cold]
    assert hot[3].text.startswith("{") and len(hot[4].tokens) == 1
    assert all(value is not None for value in hot[2].logprobs)
    assert hot[2].logprobs == pytest.approx(cold[2].logprobs, abs=1e-3)


def test_single_a_hit_joining_a_running_batch_is_computed_in_the_batch_step(
    demo_model_dir, cold_runner
):
    """A hit arriving at an empty batch gets its first token from a pass of its own, reported
    by the next step alone; one joining a running batch waits for the batch's step, which
    computes its rest with everyone's (a pass each would stall the batch once per hit)."""
    engine = SingleEngine(demo_model_dir, EngineOptions(prefix_cache_bytes=BUDGET))
    engine.load()
    try:
        shared = tuple(engine.tokenizer.encode(SYSTEM + " Joining now."))
        engine.insert(1, GenerationRequest("seed", shared, 4))
        while not any(output.uid == 1 for output in engine.step()):
            pass
        engine.remove([1])  # its prompt and first token become an entry
        alone, joining = (shared + tuple(engine.tokenizer.encode(t)) for t in (" one", " two"))
        assert engine.insert(2, GenerationRequest("alone", alone, 6)) >= len(shared) - 1
        assert engine.insert(3, GenerationRequest("joining", joining, 6)) >= len(shared) - 1
        assert [output.uid for output in engine.step()] == [2]
        joined: list[int] = []
        while len(joined) < 6:
            joined += [output.token for output in engine.step() if output.uid == 3]
        assert joined == run_one(cold_runner, GenerationRequest("cold", joining, 6)).tokens
    finally:
        engine.close()


def test_single_eviction_empties_the_store_and_the_next_turn_recomputes(demo_model_dir):
    engine = SingleEngine(demo_model_dir, EngineOptions(prefix_cache_bytes=BUDGET))
    runner = EngineRunner(engine, max_batch=4)
    runner.start(LOAD_TIMEOUT_S)
    try:
        first, _ = conversation(engine.tokenizer)
        run_one(runner, GenerationRequest("a", first, 8))
        # kept when the runner removes the sequence, just after handing over its last event
        assert wait_until(lambda: engine.info().detail["prefix_cache"]["entries"] == 1, 10)
        freed = engine.evict_prefix_cache(0.0)  # the scheduler thread is idle between requests
        snapshot = engine.info().detail["prefix_cache"]
        assert freed > 0 and snapshot["entries"] == 0 and snapshot["bytes"] == 0
        assert len(engine.prefix_store) == 0
        assert run_one(runner, GenerationRequest("b", first, 8)).cached_tokens == 0
    finally:
        runner.close()


def test_tp_over_the_ring_reuses_the_first_turn_on_every_rank(demo_model_dir, cold_runner):
    specs = loopback_ring_specs(2, demo_model_dir, EngineOptions(prefix_cache_bytes=BUDGET))
    ranks = [start_rank(spec) for spec in specs[1:]]
    engine = TensorParallelEngine(demo_model_dir, specs[0], load_timeout_s=LOAD_TIMEOUT_S)
    runner = EngineRunner(engine, max_batch=4)
    try:
        runner.start(LOAD_TIMEOUT_S)
        first, question = conversation(engine.tokenizer)
        turn_one = run_one(runner, GenerationRequest("t1", first, 16))
        second = follow_up(runner, first, turn_one.tokens, question)
        unrelated = tuple(engine.tokenizer.encode("Unrelated prompt"))
        requests = [
            GenerationRequest("t2", second, 16),
            GenerationRequest("new", unrelated, 16),
            # a grammar starts from the cached prefix too: it masks from the prompt's end
            GenerationRequest("t2-json", second, 16, grammar=GRAMMAR),
            # sampled from the hit's single pass on every rank: same draw, same logprobs
            GenerationRequest("t2-seeded", second, 8, temperature=0.9, seed=3, logprobs=2),
        ]
        turns = run_all(runner, requests)
        cold = run_all(cold_runner, requests)
        assert turns[0].cached_tokens >= len(first) and turns[1].cached_tokens == 0
        assert turns[2].cached_tokens >= len(first) and turns[2].text.startswith("{")
        assert [t.tokens for t in turns] == [c.tokens for c in cold]
        assert turns[3].logprobs == pytest.approx(cold[3].logprobs, abs=1e-3)
        snapshot = engine.info().detail["prefix_cache"]
        assert snapshot["hits"] == 3 and snapshot["entries"] >= 1
        assert engine.evict_prefix_cache(0.0) > 0  # sent to every rank while idle
        assert run_one(runner, GenerationRequest("t3", second, 4)).cached_tokens == 0
    finally:
        runner.close()
        stop_processes(ranks)


def test_a_model_with_sliding_window_caches_keeps_nothing_and_says_why(demo_model_factory):
    """A rotating cache holds a window, not every token: a prefix of it cannot be reused."""
    engine = SingleEngine(
        demo_model_factory(arch="gemma3_text", layers=2), EngineOptions(prefix_cache_bytes=BUDGET)
    )
    runner = EngineRunner(engine, max_batch=2)
    runner.start(LOAD_TIMEOUT_S)
    try:
        first, question = conversation(engine.tokenizer)
        turn_one = run_one(runner, GenerationRequest("a", first, 8))
        second = follow_up(runner, first, turn_one.tokens, question)
        assert run_one(runner, GenerationRequest("b", second, 8)).cached_tokens == 0
        snapshot = engine.info().detail["prefix_cache"]
        assert snapshot["entries"] == 0 and "sliding-window" in snapshot["off_reason"]
    finally:
        runner.close()
