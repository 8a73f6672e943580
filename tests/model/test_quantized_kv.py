"""The batched quantized KV cache: every batch operation keeps each row's quantized KV exactly."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache

from engines.model.quantized_kv import (
    QuantizedBatchCache,
    QuantizedSequenceCache,
    as_mlx_cache,
    as_sequence_cache,
)
from engines.prefix_cache.kv_prefix import kv_prefix
from planner.errors import PlanError
from planner.memory import kv_group_size

HEADS, HEAD_DIM = 2, 32


def filled(length: int, seed: int, bits: int = 8) -> QuantizedSequenceCache:
    """One sequence's cache holding `length` random tokens, written in two updates."""
    cache = QuantizedSequenceCache(kv_group_size(HEAD_DIM), bits)
    keys = mx.random.normal((1, HEADS, length, HEAD_DIM), key=mx.random.key(seed))
    values = mx.random.normal((1, HEADS, length, HEAD_DIM), key=mx.random.key(seed + 100))
    half = length // 2
    cache.update_and_fetch(keys[:, :, :half], values[:, :, :half])
    cache.update_and_fetch(keys[:, :, half:], values[:, :, half:])
    return cache


def held(cache: QuantizedSequenceCache) -> list[mx.array]:
    keys, values = cache.keys_and_values()
    return [*keys, *values]


def assert_same(got: QuantizedSequenceCache, expected: QuantizedSequenceCache) -> None:
    assert type(got) is QuantizedSequenceCache and got.offset == expected.offset
    for mine, theirs in zip(held(got), held(expected), strict=True):
        assert mine.shape == theirs.shape and mx.array_equal(mine, theirs).item()


def test_group_size_is_64_when_the_head_allows_else_32():
    assert [kv_group_size(d) for d in (32, 64, 96, 128)] == [32, 64, 32, 64]
    with pytest.raises(PlanError, match="divisible by 32"):
        kv_group_size(48)


def test_merge_extend_filter_extract_keep_every_rows_tokens():
    singles = [filled(length, seed) for seed, length in enumerate((5, 12, 1))]
    batch = QuantizedSequenceCache.merge(singles)
    assert isinstance(batch, QuantizedBatchCache) and (batch.bits, batch.size()) == (8, 12)
    for row, single in enumerate(singles):
        assert_same(batch.extract(row), single)

    others = [filled(length, seed) for seed, length in ((7, 20), (8, 3))]
    batch.extend(QuantizedSequenceCache.merge(others))  # longer rows than its own
    everyone = singles + others
    for row, single in enumerate(everyone):
        assert_same(batch.extract(row), single)

    step = mx.random.normal((5, HEADS, 1, HEAD_DIM), key=mx.random.key(42))
    batch.update_and_fetch(step, step)  # one decode step for every row
    for row, single in enumerate(everyone):
        single.update_and_fetch(step[row : row + 1], step[row : row + 1])
    batch.filter([1, 4])  # the longest row goes: the shared padding is dropped
    assert batch.size() == 13 and batch.left_padding.tolist() == [0, 9]
    assert_same(batch.extract(0), everyone[1])
    assert_same(batch.extract(1), everyone[4])
    assert batch.nbytes == sum(part.nbytes for part in (*batch.keys, *batch.values))


def test_a_right_padded_prefill_is_rolled_left_by_finalize():
    batch = QuantizedBatchCache([0, 0], kv_group_size(HEAD_DIM), 4)
    expected = [QuantizedSequenceCache(kv_group_size(HEAD_DIM), 4) for _ in range(2)]
    keys = mx.random.normal((2, HEADS, 6, HEAD_DIM), key=mx.random.key(3))
    batch.prepare(lengths=[6, 2], right_padding=[0, 4])
    batch.update_and_fetch(keys, keys)
    batch.finalize()
    expected[0].update_and_fetch(keys[:1], keys[:1])
    expected[1].update_and_fetch(keys[1:, :, :2], keys[1:, :, :2])
    assert batch.left_padding.tolist() == [0, 4] and batch.offset.tolist() == [6, 2]
    assert_same(batch.extract(0), expected[0])
    assert_same(batch.extract(1), expected[1])


def test_copies_and_mlx_lms_class_round_trip():
    cache = filled(9, 1, bits=4)
    prefix = kv_prefix(cache, 4, own=True)
    assert prefix.offset == 4 and prefix.keys[0].shape[2] == 4
    prefix.update_and_fetch(*(mx.zeros((1, HEADS, 1, HEAD_DIM)),) * 2)  # its writes stay its own
    assert_same(kv_prefix(cache, 9), cache)
    plain = as_mlx_cache(cache)
    assert type(plain) is QuantizedKVCache and (plain.group_size, plain.bits) == (32, 4)
    assert_same(as_sequence_cache(plain), cache)
