"""The quantized KV caches: a sequence's quantizes exactly when mlx-lm's generate_step does, and
every batch operation keeps each row's keys and values (full precision or quantized) exactly."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from engines.model.kv_quantization import KVQuantization, as_mlx_cache, as_sequence_cache
from engines.model.quantized_kv import QuantizedBatchCache, QuantizedSequenceCache
from engines.prefix_cache.kv_prefix import kv_prefix
from errors import PlanError
from planner.memory import kv_group_size

HEADS, HEAD_DIM = 2, 32
GROUP = kv_group_size(HEAD_DIM)


def random(length: int, seed: int, rows: int = 1) -> mx.array:
    return mx.random.normal((rows, HEADS, length, HEAD_DIM), key=mx.random.key(seed))  # (B,H,L,D)


def filled(length: int, seed: int, start: int, bits: int = 8) -> QuantizedSequenceCache:
    """One sequence's cache holding `length` random tokens, written in two passes."""
    cache = QuantizedSequenceCache(GROUP, bits, start)
    keys, values = random(length, seed), random(length, seed + 100)
    half = length // 2
    cache.update_and_fetch(keys[:, :, :half], values[:, :, :half])
    cache.update_and_fetch(keys[:, :, half:], values[:, :, half:])
    cache.settle()
    return cache


def held(cache: QuantizedSequenceCache) -> list[mx.array]:
    keys, values = cache.keys_and_values()
    return [*keys, *values] if cache.quantized else [keys, values]


def assert_same(got: QuantizedSequenceCache, expected: QuantizedSequenceCache) -> None:
    assert type(got) is QuantizedSequenceCache
    assert (got.offset, got.quantized) == (expected.offset, expected.quantized)
    for mine, theirs in zip(held(got), held(expected), strict=True):
        assert mine.shape == theirs.shape and mx.array_equal(mine, theirs).item()


def test_group_size_is_64_when_the_head_allows_else_32():
    assert [kv_group_size(d) for d in (32, 64, 96, 128)] == [32, 64, 32, 64]
    with pytest.raises(PlanError, match="divisible by 32"):
        kv_group_size(48)


@pytest.mark.parametrize("start", [0, 5, 8, 100])
def test_a_sequence_attends_over_what_mlx_lms_cache_holds_pass_by_pass(start: int):
    """mlx-lm: a KVCache, quantized by maybe_quantize_kv_cache after each pass once it holds
    `start` tokens. Each pass reads the same keys and values, quantized or not, from both."""
    mine = QuantizedSequenceCache(GROUP, 4, start)
    theirs: list = [KVCache()]
    for seed, count in enumerate((4, 3, 1, 1, 2, 1)):  # a prompt in chunks, then decode steps
        keys, values = random(count, seed), random(count, seed + 50)
        got = mine.update_and_fetch(keys, values)
        expected = theirs[0].update_and_fetch(keys, values)
        assert hasattr(mine, "bits") == hasattr(theirs[0], "bits")
        flat = [*got[0], *got[1]] if hasattr(mine, "bits") else list(got)
        wanted = [*expected[0], *expected[1]] if hasattr(theirs[0], "bits") else list(expected)
        assert all(mx.array_equal(a, b).item() for a, b in zip(flat, wanted, strict=True))
        maybe_quantize_kv_cache(theirs, start, GROUP, 4)
    mine.settle()  # taken out whole: as mlx-lm's after the last pass
    assert mine.quantized == (type(theirs[0]) is QuantizedKVCache) == (start <= 12)


def test_merge_extend_filter_extract_keep_every_rows_tokens_across_the_threshold():
    start = 10  # rows of 5 and 1 tokens are full precision, of 12 quantized
    singles = [filled(length, seed, start) for seed, length in enumerate((5, 12, 1))]
    batch = QuantizedSequenceCache.merge(singles)
    assert isinstance(batch, QuantizedBatchCache) and batch.quantized == [False, True, False]
    assert not hasattr(batch, "bits") and batch.size() == 12
    for row, single in enumerate(singles):
        assert_same(batch.extract(row), single)

    others = [filled(length, seed, start) for seed, length in ((7, 20), (8, 9))]
    batch.extend(QuantizedSequenceCache.merge(others))  # longer rows than its own
    everyone = singles + others
    for row, single in enumerate(everyone):
        assert_same(batch.extract(row), single)

    step = random(1, 42, rows=5)
    keys, values = batch.update_and_fetch(step, step)  # one decode step for every row
    for row, single in enumerate(everyone):
        alone = single.update_and_fetch(step[row : row + 1], step[row : row + 1])
        if single.quantized:  # a mixed batch attends over quantized rows dequantized
            alone = [mx.dequantize(*part, group_size=GROUP, bits=8) for part in alone]
        padding = batch.left_padding.tolist()[row]
        for got, expected in zip((keys, values), alone, strict=True):
            assert mx.array_equal(got[row : row + 1, :, padding:], expected).item()
    assert batch.quantized == [False, True, False, True, False]  # 9 + 1: quantized next pass
    batch.update_and_fetch(step, step)
    for row, single in enumerate(everyone):
        single.update_and_fetch(step[row : row + 1], step[row : row + 1])
    assert batch.quantized == [False, True, False, True, True]

    batch.filter([4, 1])  # the longest row goes: the shared padding is dropped; order changes
    assert batch.size() == 14 and batch.left_padding.tolist() == [3, 0]
    assert_same(batch.extract(0), everyone[4])
    assert_same(batch.extract(1), everyone[1])
    assert hasattr(batch, "bits")  # every row quantized: mlx-lm's quantized attention
    assert batch.nbytes == sum(part.nbytes for part in (*batch.qkeys, *batch.qvalues))


def test_a_right_padded_prefill_counts_only_real_tokens_and_is_rolled_left():
    batch = QuantizedBatchCache([0, 0], GROUP, 4, start=3)
    expected = [QuantizedSequenceCache(GROUP, 4, 3) for _ in range(2)]
    keys = random(6, 3, rows=2)
    batch.prepare(lengths=[6, 2], right_padding=[0, 4])
    batch.update_and_fetch(keys, keys)
    batch.finalize()
    assert batch.lengths == [6, 2]
    expected[0].update_and_fetch(keys[:1], keys[:1])
    expected[1].update_and_fetch(keys[1:, :, :2], keys[1:, :, :2])
    assert batch.left_padding.tolist() == [0, 4] and batch.offset.tolist() == [6, 2]
    step = random(1, 4, rows=2)
    batch.update_and_fetch(step, step)
    assert batch.quantized == [True, False]  # 6 tokens reached 3, 2 did not
    for row, single in enumerate(expected):
        single.update_and_fetch(step[row : row + 1], step[row : row + 1])
        single.settle()
        assert_same(batch.extract(row), single)


@pytest.mark.parametrize("length", [4, 9])  # under the threshold of 6, past it
def test_copies_and_mlx_lms_classes_round_trip(length: int):
    cache = filled(length, 1, start=6, bits=4)
    prefix = kv_prefix(cache, 3, own=True)
    assert (prefix.offset, prefix.quantized) == (3, cache.quantized)
    prefix.update_and_fetch(*(mx.zeros((1, HEADS, 1, HEAD_DIM)),) * 2)  # its writes stay its own
    assert_same(kv_prefix(cache, length), cache)
    plain = as_mlx_cache(cache)  # what the disk tier writes
    assert type(plain) is (QuantizedKVCache if length >= 6 else KVCache)
    read = KVQuantization(4, GROUP, 6, layers=1).adopt(as_sequence_cache(plain))
    assert_same(read, cache)
    assert read.start == 6
