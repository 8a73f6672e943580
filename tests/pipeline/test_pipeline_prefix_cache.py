"""The pipeline's prefix cache on 2 real stages: hits are reported and exact, entries live and
die on every stage together."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from discovery.cluster_key import generate_key
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.pipeline.engine import EncryptedPipelineEngine
from engines.pipeline.schedule import MicroBatchSchedule
from engines.single.engine import SingleEngine
from planner import allocate_layers
from tests.helpers.pipeline import make_engine, start_workers, status, stop_workers
from tests.helpers.prefix_turns import MAX_TOKENS, SYSTEM, Turn, ask, ask_all

pytestmark = pytest.mark.cluster

CACHE_BYTES = 64 * 1024 * 1024


@dataclass
class Warm:
    """The 4-layer demo model on 2 stages with a prefix cache, and a cold SingleEngine."""

    engine: EncryptedPipelineEngine
    runner: EngineRunner
    cold: EngineRunner


@pytest.fixture(scope="module", params=["two-stages", "relay"])
def warm(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Warm]:
    """Two stages of two layers, or a relay: stage 0 only embeds, one stage runs all four
    (planner/relay.py), and the index counts entries from the model's shape."""
    key = generate_key()
    ranges = allocate_layers(4, [8, 8]) if request.param == "two-stages" else [range(0), range(4)]
    listener, workers = start_workers(
        demo_model_dir, ranges, key, tmp_path_factory.mktemp("prefix-cache")
    )
    # 16-token chunks: a hit starts mid-chunk, the rest of the prompt is still chunked
    engine = make_engine(
        demo_model_dir,
        ranges,
        key,
        listener,
        workers,
        prefill_chunk=16,
        prefix_cache_bytes=CACHE_BYTES,
    )
    runner = EngineRunner(engine)
    cold = EngineRunner(SingleEngine(demo_model_dir))  # prefix cache off
    try:
        runner.start(load_timeout_s=60)
        cold.start(load_timeout_s=60)
        yield Warm(engine, runner, cold)
    finally:
        runner.close()
        cold.close()
        engine.close()
        stop_workers(workers)


def encode(warm: Warm, text: str) -> tuple[int, ...]:
    return tuple(warm.engine.tokenizer.encode(text))


def assert_exact(warm: Warm, prompt: tuple[int, ...], turn: Turn) -> None:
    """The tokens a cold engine gives this prompt alone."""
    cold = ask(warm.cold, prompt)
    assert cold.cached == 0
    assert (turn.tokens, turn.finish) == (cold.tokens, cold.finish)


def stage_entries(warm: Warm) -> list[tuple[int, int]]:
    """(entries, bytes) of the prefix cache on every stage, stage 0 first."""
    return [(report["prefix_entries"], report["prefix_bytes"]) for report in status(warm)]


def assert_stages_agree(warm: Warm) -> None:
    """Every stage holds exactly the entries the index lists."""
    entries = warm.engine.prefix_index.snapshot()["entries"]
    assert [count for count, _ in stage_entries(warm)] == [entries, entries]


# -- conversations -------------------------------------------------------------------------------


def test_second_turn_hits_and_matches_a_cold_engine(warm: Warm) -> None:
    first_prompt = encode(warm, SYSTEM + "Question one: what is a pipeline?")
    first = ask(warm.runner, first_prompt)
    assert first.cached == 0
    assert_exact(warm, first_prompt, first)
    second_prompt = first_prompt + tuple(first.tokens) + encode(warm, " And a second question?")
    second = ask(warm.runner, second_prompt)
    # the entry holds the prompt and every answer token but the last (never fed back)
    assert second.cached == len(first_prompt) + len(first.tokens) - 1 > 0
    assert_exact(warm, second_prompt, second)
    third_prompt = second_prompt + tuple(second.tokens) + encode(warm, " Third?")
    third = ask(warm.runner, third_prompt)
    assert third.cached == len(second_prompt) + len(second.tokens) - 1
    assert_exact(warm, third_prompt, third)
    # each turn's entry made the previous one redundant: one entry, on every stage
    assert warm.engine.prefix_index.snapshot()["entries"] == 1
    assert_stages_agree(warm)
    info = warm.engine.info().detail["prefix_cache"]
    assert info["hits"] >= 2 and info["hit_tokens"] >= second.cached + third.cached


def test_two_branches_from_one_prefix_both_hit(warm: Warm) -> None:
    system = encode(warm, SYSTEM + "Branching now.")
    trunk = ask(warm.runner, system + encode(warm, " Trunk question?"))
    assert trunk.finish is not None
    branches = [system + encode(warm, " Left branch?"), system + encode(warm, " Right one")]
    together = ask_all(warm.runner, branches)  # both start from the trunk's entry at once
    for prompt, turn in zip(branches, together, strict=True):
        assert turn.cached >= len(system)
        assert_exact(warm, prompt, turn)
    again = ask(warm.runner, branches[0])  # the entries stayed intact
    assert again.cached == len(branches[0]) - 1
    assert_exact(warm, branches[0], again)
    assert_stages_agree(warm)


def test_batch_of_four_mixes_hits_and_misses(warm: Warm) -> None:
    bases = [encode(warm, SYSTEM + f"Topic {name}.") for name in ("alpha", "beta")]
    firsts = ask_all(warm.runner, bases)
    prompts = [
        bases[0] + tuple(firsts[0].tokens) + encode(warm, " More on alpha?"),
        encode(warm, "A fresh prompt about the weather, nothing cached."),
        bases[1] + tuple(firsts[1].tokens) + encode(warm, " More on beta?"),
        encode(warm, "Another fresh one: 1, 2, 3,"),
    ]
    turns = ask_all(warm.runner, prompts)
    assert [turn.cached > 0 for turn in turns] == [True, False, True, False]
    for prompt, turn in zip(prompts, turns, strict=True):
        assert_exact(warm, prompt, turn)
    assert_stages_agree(warm)


def test_eviction_drops_entries_on_every_stage(warm: Warm) -> None:
    prompt = encode(warm, SYSTEM + "Before the eviction.")
    ask(warm.runner, prompt)
    follow_up = prompt + encode(warm, " after")
    holds_layers = [bool(warm.engine.layers), True]  # a relay's stage 0 keeps no KV
    assert [count > 0 for count, _ in stage_entries(warm)] == [True, True]
    assert [size > 0 for _, size in stage_entries(warm)] == holds_layers
    freed = warm.engine.evict_prefix_cache(0.0)
    assert freed > 0
    assert warm.engine.prefix_index.snapshot()["entries"] == 0
    assert stage_entries(warm) == [(0, 0), (0, 0)]
    missed = ask(warm.runner, follow_up)
    assert missed.cached == 0
    assert_exact(warm, follow_up, missed)
    assert_stages_agree(warm)
    hit = ask(warm.runner, follow_up)  # kept again after the eviction
    assert hit.cached == len(follow_up) - 1
    assert_exact(warm, follow_up, hit)


def test_a_reconnect_forgets_every_entry(warm: Warm) -> None:
    prompt = encode(warm, SYSTEM + "Across a reconnect.")
    ask(warm.runner, prompt)
    assert warm.engine.prefix_index.snapshot()["entries"] > 0
    status(warm)  # waits for the runner's last removal
    warm.engine.connect()  # a new session: the stages' entries are gone with the old one
    assert warm.engine.prefix_index.snapshot()["entries"] == 0
    assert stage_entries(warm) == [(0, 0), (0, 0)]
    again = ask(warm.runner, prompt)
    assert again.cached == 0
    assert_exact(warm, prompt, again)


def generate(engine: EncryptedPipelineEngine, uid: int) -> list[int]:
    """Step until `uid` (inserted) has MAX_TOKENS tokens (the engine alone, on this thread)."""
    tokens: list[int] = []
    for _ in range(1000):
        tokens += [output.token for output in engine.step() if output.uid == uid]
        if len(tokens) >= MAX_TOKENS:
            return tokens[:MAX_TOKENS]
    raise AssertionError(f"sequence {uid} produced {len(tokens)} tokens in 1000 steps")


def test_an_entry_evicted_before_its_hit_begins_is_dropped_after(
    warm: Warm, demo_model_dir: Path, tmp_path: Path
) -> None:
    """Evicting the entry a waiting newcomer will start from: the stages keep it until the
    newcomer's BEGIN went down, then drop it; the newcomer is exact."""
    key = generate_key()
    ranges = allocate_layers(4, [8, 8])
    listener, workers = start_workers(demo_model_dir, ranges, key, tmp_path)
    engine = make_engine(
        demo_model_dir, ranges, key, listener, workers, prefix_cache_bytes=CACHE_BYTES
    )
    try:
        engine.load()
        prompt = tuple(engine.tokenizer.encode(SYSTEM + "Pinned entry."))
        engine.insert(0, GenerationRequest("first", prompt, MAX_TOKENS))
        answer = generate(engine, 0)
        engine.remove([0])
        follow_up = prompt + tuple(answer) + tuple(engine.tokenizer.encode(" Next?"))
        cached = engine.insert(1, GenerationRequest("pinned", follow_up, MAX_TOKENS))
        assert cached == len(prompt) + len(answer) - 1
        assert engine.evict_prefix_cache(0.0) > 0  # the index forgets entry 0 at once ...
        assert engine.prefix_index.snapshot()["entries"] == 0
        tokens = generate(engine, 1)  # ... the stages still start uid 1 from it
        assert tokens == ask(warm.cold, follow_up).tokens
        engine.remove([1])
        # entry 0 is gone everywhere now; uid 1's caches are the only entry
        assert [report["prefix_entries"] for report in engine.stage_status()] == [1, 1]
        assert engine.prefix_index.snapshot()["entries"] == 1
    finally:
        engine.close()
        stop_workers(workers)


# -- the schedule --------------------------------------------------------------------------------


def test_schedule_prefills_a_hit_from_its_cached_length() -> None:
    schedule = MicroBatchSchedule(groups=1, prefill_chunk=4, prefill_in_flight=2)
    schedule.add(1, list(range(10, 20)), cached=3)
    first, second = schedule.plan()
    assert [(row.uid, row.position) for row in first.rows] == [(1, 3)]
    assert first.tokens == (13, 14, 15, 16) and first.begins == (1,) and not first.last_chunk
    assert second.rows[0].position == 7 and second.tokens == (17, 18, 19) and second.last_chunk
    assert schedule.answered([]) == [] and schedule.answered([42]) == [(1, 42)]
    (decode,) = schedule.plan()
    assert decode.rows[0].position == 10 and decode.tokens == (42,)
    schedule.add(2, [5, 6, 7], cached=2)  # the whole prompt but its last token
    assert schedule.cached(2) == 2
    (last,) = schedule.plan()  # (1's decode is in flight) the last token samples at once
    assert last.rows[0].position == 2 and last.tokens == (7,) and last.last_chunk
    with pytest.raises(ValueError):
        schedule.add(3, [5, 6], cached=2)  # the last token is always computed


def test_schedule_start_cold_prefills_everything() -> None:
    schedule = MicroBatchSchedule(groups=1, prefill_chunk=8, prefill_in_flight=1)
    schedule.add(1, [1, 2, 3], cached=2)
    schedule.start_cold(1)
    frame = schedule.plan()[0]  # the whole prompt, sampling its first token
    assert frame.is_prefill and frame.rows[0].position == 0 and frame.tokens == (1, 2, 3)
    assert frame.last_chunk
    with pytest.raises(ValueError):
        schedule.start_cold(1)  # it has begun
