"""The prefix cache's disk tier: the index's two LRU tiers, the files, and the single engine
reading an evicted conversation back from disk instead of prefilling it again."""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from engines.core.engine_options import EngineOptions
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.prefix_cache.disk_tier import DiskTier, DiskUnreadable, tier_root
from engines.prefix_cache.index import MIN_DISK_HIT_TOKENS, PrefixHit, PrefixIndex
from engines.prefix_cache.store import PrefixStore
from engines.single.engine import SingleEngine
from tests.helpers.engine import run_one

LOAD_TIMEOUT_S = 120
SYSTEM = "You are a careful assistant. Answer in full sentences and cite what you use. " * 12

# -- the index ------------------------------------------------------------------------------


def test_memory_evictions_go_to_disk_and_still_hit():
    index = PrefixIndex(100, disk_bytes=100, min_disk_hit_tokens=1)
    index.add(1, (1,) * 4, 60)
    assert index.add(2, (2,) * 4, 60) == []  # entry 1 is not dropped: it moves to disk
    assert index.take_spills() == [1] and index.take_spills() == []
    assert index.on_disk(1) and not index.on_disk(2) and 1 in index
    assert index.lookup((1, 1, 1, 1, 5)) == PrefixHit(1, 4, on_disk=True)
    snapshot = index.snapshot()
    assert (snapshot["bytes"], snapshot["disk_bytes"], snapshot["disk_entries"]) == (60, 60, 1)
    assert (snapshot["disk_hits"], snapshot["spills"]) == (1, 1)


def test_the_disk_tier_keeps_its_own_lru_budget():
    index = PrefixIndex(50, disk_bytes=100, min_disk_hit_tokens=1)
    index.add(1, (1,) * 4, 40)
    index.add(2, (2,) * 4, 40)  # 1 -> disk
    index.add(3, (3,) * 4, 40)  # 2 -> disk
    index.lookup((1, 1, 1, 1, 9))  # on disk, now its most recent
    assert index.add(4, (4,) * 4, 40) == [2]  # 3 -> disk; the disk drops its oldest: 2
    assert index.take_spills() == [1, 3]  # 2 was dropped before any store wrote it
    assert [entry for entry in (1, 2, 3, 4) if entry in index] == [1, 3, 4]


def test_a_longer_entry_replaces_its_prefix_on_disk_and_whole_tiers_clear():
    index = PrefixIndex(50, disk_bytes=200, min_disk_hit_tokens=1)
    index.add(1, (1, 2, 3), 40)
    index.evict(0.0)  # memory pressure: everything to disk
    assert index.take_spills() == [1] and index.nbytes == 0
    assert index.add(2, (1, 2, 3, 4, 5), 45) == [1]
    assert 1 not in index
    index.add(3, (7,) * 4, 150)  # too big for memory, not for disk: straight there
    assert index.on_disk(3) and index.take_spills() == [3]
    assert index.add(4, (8,) * 4, 500) == [4]  # too big for both
    assert sorted(index.clear()) == [2, 3] and len(index) == 0


def test_a_disk_hit_needs_enough_shared_tokens_to_pay_for_its_read():
    index = PrefixIndex(100, disk_bytes=1000)  # the measured minimum: MIN_DISK_HIT_TOKENS
    index.add(1, tuple(range(200)), 60)
    index.add(2, tuple(range(1000, 1200)), 60)  # 1 -> disk
    short = tuple(range(MIN_DISK_HIT_TOKENS - 1)) + (9999,)
    assert index.lookup(short) is None  # a template's worth: prefilled, not read back
    assert index.lookup(tuple(range(MIN_DISK_HIT_TOKENS)) + (9999,)) == PrefixHit(
        1, MIN_DISK_HIT_TOKENS, on_disk=True
    )
    assert index.lookup((1000, 1001, 9999)) == PrefixHit(2, 2)  # memory hits have no minimum


def test_without_a_disk_budget_evictions_are_dropped():
    index = PrefixIndex(100)
    index.add(1, (1,) * 4, 60)
    assert index.add(2, (2,) * 4, 60) == [1]
    assert index.take_spills() == []


# -- the files ------------------------------------------------------------------------------


def kv(tokens: int, width: int = 8) -> KVCache:
    cache = KVCache()
    keys = mx.arange(tokens * width, dtype=mx.float32).reshape(1, 1, tokens, width)
    cache.update_and_fetch(keys, keys * 2)
    return cache


def written_store(root: Path, identity: str = "model/single") -> tuple[PrefixStore, DiskTier]:
    disk = DiskTier(root, identity)
    disk.open()
    store = PrefixStore(disk)
    store.put(7, [kv(5), kv(5)], (1, 2, 3, 4, 5))
    store.spill([7])
    return store, disk


def test_entries_round_trip_through_files_written_in_the_background(tmp_path: Path):
    store, disk = written_store(tmp_path)
    assert len(store) == 0 and 7 in store  # out of memory, still held
    caches, tokens = store.take_prefix(7, 3)  # maybe before its file is written: the copy
    assert tokens == [1, 2, 3] and caches[0].offset == 3
    assert disk.flush() and len(list(tmp_path.glob("*.safetensors"))) == 1 and disk.nbytes > 0
    caches, tokens = store.take_prefix(7, 5)  # from the file
    expected = kv(5)
    assert tokens == [1, 2, 3, 4, 5] and caches[1].offset == 5
    assert mx.array_equal(caches[1].keys[..., :5, :], expected.keys[..., :5, :]).item()
    assert mx.array_equal(caches[1].values[..., :5, :], expected.values[..., :5, :]).item()
    store.drop([7])
    assert 7 not in store and not list(tmp_path.glob("*.safetensors"))
    store.close()


def test_a_reopened_tier_finds_its_entries_and_ignores_foreign_and_torn_ones(tmp_path: Path):
    store, disk = written_store(tmp_path)
    disk.flush()
    store.close()
    (tmp_path / "0123.safetensors").write_bytes(b"torn: no .json beside it")
    again = DiskTier(tmp_path, "model/single")
    found = again.open()
    assert [(entry.tokens, entry.nbytes > 0) for entry in found] == [((1, 2, 3, 4, 5), True)]
    assert not (tmp_path / "0123.safetensors").exists()
    again.adopt(-1, found[0])
    caches, tokens = again.read(-1)
    assert tokens == (1, 2, 3, 4, 5) and caches[0].offset == 5
    again.close()
    assert DiskTier(tmp_path, "another/share").open() == []  # another plan's: never used
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_or_truncated_file_is_unreadable_never_wrong(tmp_path: Path, damage: str):
    store, disk = written_store(tmp_path)
    disk.flush()
    (data,) = tmp_path.glob("*.safetensors")
    content = bytearray(data.read_bytes())
    if damage == "flip":
        content[-3] ^= 0xFF  # inside the last array
    else:
        content = content[: len(content) // 2]
    data.write_bytes(bytes(content))
    with pytest.raises(DiskUnreadable):
        store.take_prefix(7, 5)
    store.close()


def test_a_second_process_on_the_same_directory_gets_a_private_one(tmp_path: Path):
    first = DiskTier(tmp_path, "x")
    first.open()
    second = DiskTier(tmp_path, "x")
    assert second.open() == [] and second.directory != first.directory
    second.close()
    assert not second.directory.exists()
    first.close()


def test_tier_roots_separate_models_and_shares(tmp_path: Path):
    for name in ("model-a", "model-b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"weights")
    one = tier_root(tmp_path, tmp_path / "model-a", "single")
    assert one.parent.parent == tmp_path and one.name == "single"
    assert one != tier_root(tmp_path, tmp_path / "model-b", "single")
    assert one != tier_root(tmp_path, tmp_path / "model-a", "layers-0-3")
    (tmp_path / "model-a" / "model.safetensors").write_bytes(b"new weights")
    assert one != tier_root(tmp_path, tmp_path / "model-a", "single")


def test_the_index_restores_oldest_first_within_the_disk_budget():
    index = PrefixIndex(100, disk_bytes=100, min_disk_hit_tokens=1)
    assert index.restore(-1, (1,) * 4, 60) == []
    assert index.restore(-2, (2,) * 4, 60) == [-1]  # the budget holds: the oldest goes
    assert index.lookup((2, 2, 2, 2, 7)) == PrefixHit(-2, 4, on_disk=True)
    assert index.take_spills() == []  # already on disk: nothing to write
    index.discard(-2)
    assert len(index) == 0 and index.snapshot()["disk_failures"] == 1


# -- the single engine ------------------------------------------------------------------------


def disk_engine(model: Path, cache_dir: Path) -> SingleEngine:
    """A single engine whose disk tier is tier_root(cache_dir, model, "single")."""
    options = EngineOptions(
        prefix_cache_bytes=1 << 28, prefix_cache_disk_bytes=1 << 28, prefix_cache_dir=str(cache_dir)
    )
    return SingleEngine(model, options)


def started(engine: SingleEngine) -> EngineRunner:
    runner = EngineRunner(engine, max_batch=4)
    runner.start(LOAD_TIMEOUT_S)
    return runner


def evict_all(runner: EngineRunner) -> None:
    before, freed = runner.prefix_evictions, runner.prefix_evicted_bytes
    runner.request_prefix_eviction(0.0)  # memory pressure: all of memory's entries go
    deadline = time.monotonic() + 30
    while runner.prefix_evictions == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.prefix_evicted_bytes > freed


def test_single_an_entry_on_disk_serves_the_next_turn_exactly_also_after_a_restart(
    demo_model_dir: Path, tmp_path: Path
):
    root = tier_root(tmp_path / "prefix-cache", demo_model_dir, "single")
    runner = started(disk_engine(demo_model_dir, root.parents[1]))
    try:
        tokenizer = runner.engine.tokenizer
        first = tuple(tokenizer.encode(SYSTEM + " Question one: what is a fox?"))
        turn_one = run_one(runner, GenerationRequest("t1", first, 12))
        evict_all(runner)
        snapshot = runner.engine.prefix_index.snapshot()
        assert snapshot["bytes"] == 0 and snapshot["disk_entries"] == 1
        assert runner.engine.prefix_store.disk.flush()
        second = first + tuple(turn_one.tokens) + tuple(tokenizer.encode(" Question two?"))
        turn_two = run_one(runner, GenerationRequest("t2", second, 12))
        assert turn_two.cached_tokens >= len(first)
        assert runner.engine.prefix_index.snapshot()["disk_hits"] == 1
        evict_all(runner)  # the second turn's entry too (it replaces the first)
        runner.engine.prefix_store.disk.flush()
    finally:
        runner.close()

    cold_runner = started(SingleEngine(demo_model_dir))
    try:
        cold = run_one(cold_runner, GenerationRequest("c2", second, 12))
    finally:
        cold_runner.close()
    assert turn_two.tokens == cold.tokens and len(cold.tokens) == 12

    restarted = started(
        disk_engine(demo_model_dir, root.parents[1])
    )  # a new engine, same model and share
    try:
        assert restarted.engine.prefix_index.snapshot()["disk_entries"] == 1
        third = second + tuple(turn_two.tokens) + tuple(tokenizer.encode(" And three?"))
        turn_three = run_one(restarted, GenerationRequest("t3", third, 12))
        assert turn_three.cached_tokens >= len(second)
        evict_all(restarted)
        restarted.engine.prefix_store.disk.flush()
    finally:
        restarted.close()
    cold_runner = started(SingleEngine(demo_model_dir))
    try:
        assert turn_three.tokens == run_one(cold_runner, GenerationRequest("c3", third, 12)).tokens
    finally:
        cold_runner.close()

    (data,) = root.glob("*.safetensors")  # damage the entry in place: same size, wrong bytes
    content = bytearray(data.read_bytes())
    content[-3] ^= 0xFF
    data.write_bytes(bytes(content))
    damaged = started(disk_engine(demo_model_dir, root.parents[1]))
    try:
        assert damaged.engine.prefix_index.snapshot()["disk_entries"] == 1
        again = run_one(damaged, GenerationRequest("t3-again", third, 12))
        snapshot = damaged.engine.prefix_index.snapshot()
    finally:
        damaged.close()
    assert again.cached_tokens == 0 and snapshot["disk_failures"] == 1  # a miss, not an error
    assert again.tokens == turn_three.tokens


# -- tensor parallel ------------------------------------------------------------------------


def test_tp_every_rank_spills_its_shard_and_a_disk_hit_equals_a_cold_engine(
    demo_model_dir: Path, tmp_path: Path
):
    from engines.tensor_parallel.engine import TensorParallelEngine
    from engines.tensor_parallel.group import loopback_ring_specs
    from tests.helpers.tensor_parallel import start_rank, stop_processes

    disk = {"prefix_cache_disk_bytes": 1 << 28, "prefix_cache_dir": str(tmp_path / "tiers")}
    specs = loopback_ring_specs(
        2, demo_model_dir, EngineOptions(prefix_cache_bytes=1 << 28, **disk)
    )
    ranks = [start_rank(spec) for spec in specs[1:]]
    engine = TensorParallelEngine(demo_model_dir, specs[0], load_timeout_s=LOAD_TIMEOUT_S)
    runner = EngineRunner(engine, max_batch=4)
    try:
        runner.start(LOAD_TIMEOUT_S)
        tokenizer = engine.tokenizer
        first = tuple(tokenizer.encode(SYSTEM + " Question one: what is a fox?"))
        turn_one = run_one(runner, GenerationRequest("t1", first, 12))
        evict_all(runner)  # spill orders reach every rank while idle
        snapshot = engine.info().detail["prefix_cache"]
        assert snapshot["bytes"] == 0 and snapshot["disk_entries"] == 1
        deadline = time.monotonic() + 30
        shares = ("tp-0of2", "tp-1of2")
        while time.monotonic() < deadline and not all(
            list((tmp_path / "tiers").rglob(f"{share}/*.json")) for share in shares
        ):
            time.sleep(0.05)
        assert all(list((tmp_path / "tiers").rglob(f"{share}/*.json")) for share in shares)
        second = first + tuple(turn_one.tokens) + tuple(tokenizer.encode(" Question two?"))
        turn_two = run_one(runner, GenerationRequest("t2", second, 12))
        assert turn_two.cached_tokens >= len(first)
        assert engine.info().detail["prefix_cache"]["disk_hits"] == 1
    finally:
        runner.close()
        stop_processes(ranks)
    cold_runner = started(SingleEngine(demo_model_dir))
    try:
        assert turn_two.tokens == run_one(cold_runner, GenerationRequest("c2", second, 12)).tokens
    finally:
        cold_runner.close()
