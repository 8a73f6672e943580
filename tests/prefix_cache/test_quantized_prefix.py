"""The prefix cache with --kv-bits: quantized entries are kept, cut, spilled to disk and read
back, and a hit answers exactly as a cold quantized engine does."""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx

from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.model.quantized_kv import QuantizedSequenceCache
from engines.prefix_cache.disk_tier import DiskTier, tier_root
from engines.prefix_cache.store import PrefixStore
from engines.single.engine import SingleEngine
from tests.helpers.cluster import wait_until
from tests.helpers.engine import run_all, run_one

LOAD_TIMEOUT_S = 120
BITS = 4
SYSTEM = "You are a careful assistant. Answer in full sentences and cite what you use. " * 12


def started(engine: SingleEngine) -> EngineRunner:
    runner = EngineRunner(engine, max_batch=4)
    runner.start(LOAD_TIMEOUT_S)
    return runner


def evict_all(runner: EngineRunner) -> None:
    before = runner.prefix_evictions
    runner.request_prefix_eviction(0.0)
    deadline = time.monotonic() + 30
    while runner.prefix_evictions == before and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_quantized_hit_from_memory_and_from_disk_equals_a_cold_engine(
    demo_model_dir: Path, tmp_path: Path
):
    root = tier_root(tmp_path / "prefix-cache", demo_model_dir, "single")
    cached = started(
        SingleEngine(
            demo_model_dir, prefix_cache_bytes=1 << 28, prefix_cache_disk_bytes=1 << 28,
            prefix_cache_disk_root=root, kv_bits=BITS,
        )
    )  # fmt: skip
    try:
        tokenizer = cached.engine.tokenizer
        first = tuple(tokenizer.encode(SYSTEM + " Question one: what is a fox?"))
        turn_one = run_one(cached, GenerationRequest("t1", first, 12))
        # kept when the runner removes the sequence, just after handing over its last event
        assert wait_until(lambda: len(cached.engine.prefix_store._entries) == 1, 10)
        ((caches, _),) = cached.engine.prefix_store._entries.values()
        assert all(type(cache) is QuantizedSequenceCache for cache in caches)
        assert all(cache.bits == BITS and cache.keys[0].dtype == mx.uint32 for cache in caches)
        second = first + tuple(turn_one.tokens) + tuple(tokenizer.encode(" Question two?"))
        branches = [  # two branches of one entry, in one batch: each cut from it
            GenerationRequest("b1", first[:-3] + tuple(tokenizer.encode(" left")), 10),
            GenerationRequest("b2", second, 12),
        ]
        from_memory = run_all(cached, branches)
        assert all(outcome.cached_tokens >= len(first) - 4 for outcome in from_memory)

        evict_all(cached)  # every entry to disk, read back on the next hit
        assert cached.engine.prefix_store.disk.flush()
        third = second + tuple(from_memory[1].tokens) + tuple(tokenizer.encode(" And three?"))
        from_disk = run_one(cached, GenerationRequest("t3", third, 12))
        assert from_disk.cached_tokens >= len(second)
        assert cached.engine.prefix_index.snapshot()["disk_hits"] == 1
    finally:
        cached.close()

    cold = started(SingleEngine(demo_model_dir, kv_bits=BITS))
    try:
        assert [o.tokens for o in run_all(cold, branches)] == [o.tokens for o in from_memory]
        assert run_one(cold, GenerationRequest("c3", third, 12)).tokens == from_disk.tokens
    finally:
        cold.close()


def test_the_disk_tier_round_trips_a_quantized_entry(tmp_path: Path):
    cache = QuantizedSequenceCache(32, 8)
    keys = mx.random.normal((1, 2, 7, 32), key=mx.random.key(0))
    cache.update_and_fetch(keys, -keys)
    disk = DiskTier(tmp_path, "model/single")
    disk.open()
    store = PrefixStore(disk)
    store.put(3, [cache], range(7))
    store.spill([3])
    assert disk.flush() and len(list(tmp_path.glob("*.safetensors"))) == 1
    disk.close()

    again = DiskTier(tmp_path, "model/single")  # a restart: read back from the file
    (stored,) = again.open()
    again.adopt(-1, stored)
    (read,), tokens = PrefixStore(again).take_prefix(-1, 5)
    assert tokens == [0, 1, 2, 3, 4] and type(read) is QuantizedSequenceCache
    assert (read.offset, read.group_size, read.bits) == (5, 32, 8)
    expected = [part[..., :5, :] for part in (*cache.keys, *cache.values)]
    got = [part[..., :5, :] for part in (*read.keys, *read.values)]
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, expected, strict=True))
    again.close()


def test_entries_on_disk_of_another_kv_quantization_are_never_read(
    demo_model_dir: Path, tmp_path: Path
):
    root = tmp_path / "tier"

    def engine(bits: int) -> SingleEngine:
        return SingleEngine(
            demo_model_dir, prefix_cache_bytes=1 << 28, prefix_cache_disk_bytes=1 << 28,
            prefix_cache_disk_root=root, kv_bits=bits,
        )  # fmt: skip

    plain = started(engine(0))
    try:
        first = tuple(plain.engine.tokenizer.encode(SYSTEM + " Question one?"))
        run_one(plain, GenerationRequest("t1", first, 4))
        evict_all(plain)
        assert plain.engine.prefix_store.disk.flush()
    finally:
        plain.close()
    quantized = started(engine(BITS))
    try:
        assert quantized.engine.prefix_index.snapshot()["disk_entries"] == 0
        again = run_one(quantized, GenerationRequest("t1", first + (5, 6), 4))
        assert again.cached_tokens == 0 and len(again.tokens) == 4
    finally:
        quantized.close()
