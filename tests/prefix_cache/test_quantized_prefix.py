"""The prefix cache with --kv-bits: entries hold what the sequence's cache held (quantized past
--quantized-kv-start, full precision under it), are cut, spilled to disk and read back, and a
hit answers exactly as mlx-lm going on from that cache."""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from engines.core.engine_options import EngineOptions
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.model.kv_quantization import as_mlx_cache
from engines.model.quantized_kv import QuantizedSequenceCache
from engines.prefix_cache.disk_tier import DiskTier
from engines.prefix_cache.kv_prefix import kv_prefix
from engines.prefix_cache.store import PrefixStore
from engines.single.engine import SingleEngine
from tests.helpers.cluster import wait_until
from tests.helpers.engine import run_one

LOAD_TIMEOUT_S = 120
BITS = 4
CHUNK = 64
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


def mlx_lm_continuation(model, caches: list, rest: tuple, start: int, max_tokens: int) -> list:
    """mlx-lm's greedy tokens going on from a copy of `caches` (as mlx-lm's classes) by `rest`."""
    copies = [as_mlx_cache(kv_prefix(cache, cache.offset, own=True)) for cache in caches]
    steps = generate_step(
        mx.array(rest), model, prompt_cache=copies, max_tokens=max_tokens, kv_bits=BITS,
        kv_group_size=32, quantized_kv_start=start, prefill_step_size=CHUNK,
    )  # fmt: skip
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("where", ["above", "crossed by the hit", "below"])
def test_a_hit_from_memory_and_from_disk_goes_on_as_mlx_lm_does_from_that_cache(
    demo_model_dir: Path, tmp_path: Path, where: str
):
    """An entry holds what the sequence's cache held: quantized past the threshold, full
    precision under it; a hit on it answers as mlx-lm's generate_step going on from it."""
    model, tokenizer = load(str(demo_model_dir))
    first = tuple(tokenizer.encode(SYSTEM + " Question one: what is a fox?"))
    more = tuple(tokenizer.encode(" Question two, a longer one: what is a dog, and why?"))
    start = {"above": 0, "crossed by the hit": len(first) + 16, "below": 10**6}[where]
    options = EngineOptions(
        prefill_chunk=CHUNK, prefix_cache_bytes=1 << 28, prefix_cache_disk_bytes=1 << 28,
        prefix_cache_dir=str(tmp_path / "prefix-cache"), kv_bits=BITS, quantized_kv_start=start,
    )  # fmt: skip
    cached = started(SingleEngine(demo_model_dir, options))
    try:
        turn_one = run_one(cached, GenerationRequest("t1", first, 12))
        # kept when the runner removes the sequence, just after handing over its last event
        assert wait_until(lambda: len(cached.engine.prefix_store._entries) == 1, 10)
        ((caches, tokens),) = cached.engine.prefix_store._entries.values()
        assert all(type(cache) is QuantizedSequenceCache for cache in caches)
        assert all(cache.quantized == (where == "above") for cache in caches)
        if where == "above":
            assert all(cache.keys[0].dtype == mx.uint32 for cache in caches)
        second = first + tuple(turn_one.tokens) + more
        hit = run_one(cached, GenerationRequest("t2", second, 12))
        assert hit.cached_tokens >= len(first)
        held = [kv_prefix(cache, hit.cached_tokens) for cache in caches]
        rest = second[hit.cached_tokens :]
        assert hit.tokens == mlx_lm_continuation(model, held, rest, start, 12)

        evict_all(cached)  # every entry to disk, read back on the next hit
        assert cached.engine.prefix_store.disk.flush()
        disk = cached.engine.prefix_store.disk
        on_disk = [disk.read(entry) for entry in list(disk._keys)]  # as a hit reads them back
        third = second[:-2] + tuple(tokenizer.encode(" And three?"))
        from_disk = run_one(cached, GenerationRequest("t3", third, 12))
        reused = from_disk.cached_tokens
        assert reused >= len(first) and cached.engine.prefix_index.snapshot()["disk_hits"] == 1
        matching = next(caches for caches, ids in on_disk if ids[:reused] == third[:reused])
        held = [kv_prefix(cache, from_disk.cached_tokens) for cache in matching]
        rest = third[from_disk.cached_tokens :]
        assert from_disk.tokens == mlx_lm_continuation(model, held, rest, start, 12)
    finally:
        cached.close()


def test_the_disk_tier_round_trips_a_quantized_entry(tmp_path: Path):
    cache = QuantizedSequenceCache(32, 8, start=0)
    keys = mx.random.normal((1, 2, 7, 32), key=mx.random.key(0))
    cache.update_and_fetch(keys, -keys)
    cache.settle()
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
    assert (read.offset, read.group_size, read.bits, read.quantized) == (5, 32, 8, True)
    expected = [part[..., :5, :] for part in (*cache.keys, *cache.values)]
    got = [part[..., :5, :] for part in (*read.keys, *read.values)]
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, expected, strict=True))
    again.close()


def test_entries_on_disk_of_another_kv_quantization_are_never_read(
    demo_model_dir: Path, tmp_path: Path
):
    # one folder (the same bits), another quantization: the entries quantized from token 0
    def engine(start: int) -> SingleEngine:
        options = EngineOptions(
            prefix_cache_bytes=1 << 28, prefix_cache_disk_bytes=1 << 28,
            prefix_cache_dir=str(tmp_path / "tier"), kv_bits=BITS, quantized_kv_start=start,
        )  # fmt: skip
        return SingleEngine(demo_model_dir, options)

    plain = started(engine(0))
    try:
        first = tuple(plain.engine.tokenizer.encode(SYSTEM + " Question one?"))
        run_one(plain, GenerationRequest("t1", first, 4))
        evict_all(plain)
        assert plain.engine.prefix_store.disk.flush()
    finally:
        plain.close()
    quantized = started(engine(10**6))
    try:
        assert quantized.engine.prefix_index.snapshot()["disk_entries"] == 0
        again = run_one(quantized, GenerationRequest("t1", first + (5, 6), 4))
        assert again.cached_tokens == 0 and len(again.tokens) == 4
    finally:
        quantized.close()
