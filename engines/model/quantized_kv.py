"""Quantized KV caches that batch: one sequence's (mlx-lm's QuantizedKVCache, made mergeable)
and a left-padded batch of them, which mlx-lm 0.32.2 lacks (so mlx_lm.server with --kv-bits
does not batch).

Keys and values are kept as mx.quantize triples (packed uint32, scales, biases), each
(B, kv_heads, T, ·); every batch operation is applied to the three arrays alike. Attention
sees `bits` and `group_size` on the cache and runs mlx-lm's quantized attention, whose array
mask carries the left padding. Tokens are quantized from the first one on (mlx_lm.server
quantizes only past --quantized-kv-start).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    BatchKVCache,
    KVCache,
    QuantizedKVCache,
    dynamic_roll,
    make_prompt_cache,
)

from planner.errors import EngineError
from planner.memory import KV_BITS, kv_group_size

Triple = tuple[mx.array, mx.array, mx.array]  # packed (·, D*bits/32), scales, biases (·, D/g)


class QuantizedSequenceCache(QuantizedKVCache):
    """One sequence's quantized KV: mlx-lm's cache plus what BatchGenerator needs to batch it."""

    def size(self) -> int:
        return self.offset

    @classmethod
    def merge(cls, caches: list[QuantizedSequenceCache]) -> QuantizedBatchCache:
        return QuantizedBatchCache.merge(caches)


class QuantizedBatchCache(BatchKVCache):
    """A left-padded batch of quantized KV (BatchKVCache's bookkeeping: `offset` per row,
    `left_padding`, `_idx` the filled length), keys and values as quantized triples."""

    def __init__(self, left_padding: list[int], group_size: int, bits: int) -> None:
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        start, count = self._idx, keys.shape[2]  # keys, values: (B, kv_heads, count, D)
        if self.keys is None or start + count > self.keys[0].shape[2]:
            self._grow(keys, values, count)
        new_keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        new_values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for stored, new in zip((*self.keys, *self.values), (*new_keys, *new_values), strict=True):
            stored[..., start : start + count, :] = new
        self.offset = self.offset + count
        self._idx += count
        return self.keys_and_values()

    def _grow(self, keys: mx.array, values: mx.array, count: int) -> None:
        """Room for `count` more tokens, in whole steps (as mlx-lm's caches grow)."""
        steps = (count + self.step - 1) // self.step * self.step
        rows, heads = keys.shape[:2]
        more_keys = _zeros((rows, heads, steps), keys.shape[-1], keys.dtype, self)
        more_values = _zeros((rows, heads, steps), values.shape[-1], values.dtype, self)
        if self.keys is None:
            self.keys, self.values = more_keys, more_values
            return
        self.keys = _joined(self.keys, more_keys, self._idx)
        self.values = _joined(self.values, more_values, self._idx)

    def keys_and_values(self) -> tuple[Triple, Triple]:
        return _cut(self.keys, 0, self._idx), _cut(self.values, 0, self._idx)

    def finalize(self) -> None:
        """After a right-padded prefill: roll each row's padding to its left."""
        if self._right_padding is None:
            return
        shifts = self._right_padding[:, None]
        self.keys = tuple(dynamic_roll(part, shifts, axis=2) for part in self.keys)
        self.values = tuple(dynamic_roll(part, shifts, axis=2) for part in self.values)
        self.offset = self.offset - self._right_padding
        self.left_padding = self.left_padding + self._right_padding
        self._right_padding = None

    def filter(self, batch_indices: list[int]) -> None:
        """Keep these rows, then drop the padding columns every remaining row shares."""
        indices = mx.array(batch_indices)
        if self.keys is not None:
            self.keys = tuple(part[indices] for part in self.keys)
            self.values = tuple(part[indices] for part in self.values)
        self.offset = self.offset[indices]
        self.left_padding = self.left_padding[indices]
        shared = min(self.left_padding.tolist())
        if shared > 0:
            if self.keys is not None:
                self.keys = tuple(part[..., shared:, :] for part in self.keys)
                self.values = tuple(part[..., shared:, :] for part in self.values)
            self._idx -= shared
            self.left_padding = self.left_padding - shared

    def extend(self, other: QuantizedBatchCache) -> None:
        """Append other's rows, both right-aligned at the longer filled length."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        filled = max(self._idx, other._idx)
        width = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        template = self if self.keys is not None else other
        parts = [_aligned(cache, template, filled, width) for cache in (self, other)]
        self.keys = tuple(
            mx.concatenate(pair) for pair in zip(*(part[0] for part in parts), strict=True)
        )
        self.values = tuple(
            mx.concatenate(pair) for pair in zip(*(part[1] for part in parts), strict=True)
        )
        self.left_padding = mx.concatenate([parts[0][2], parts[1][2]])
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = filled

    def extract(self, idx: int) -> QuantizedSequenceCache:
        """Row `idx` alone, without its padding, in arrays of its own."""
        padding = self.left_padding.tolist()[idx]
        cache = QuantizedSequenceCache(self.group_size, self.bits)
        rows = slice(idx, idx + 1)
        cache.keys = tuple(mx.contiguous(part[rows, :, padding : self._idx]) for part in self.keys)
        cache.values = tuple(
            mx.contiguous(part[rows, :, padding : self._idx]) for part in self.values
        )
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches: list[QuantizedSequenceCache]) -> QuantizedBatchCache:
        """One batch from single sequences, each right-aligned (left-padded)."""
        group_size, bits = caches[0].group_size, caches[0].bits
        lengths = [cache.size() for cache in caches]
        longest = max(lengths)
        padding = [longest - length for length in lengths]
        batch = cls(padding, group_size, bits)
        if longest == 0:
            return batch
        sample = next(cache for cache in caches if cache.keys is not None)
        heads, dtype = sample.keys[0].shape[1], sample.keys[1].dtype
        shape = (len(caches), heads, longest)
        batch.keys = _zeros(shape, _head_dim(sample.keys, bits), dtype, batch)
        batch.values = _zeros(shape, _head_dim(sample.values, bits), dtype, batch)
        for row, (pad, cache) in enumerate(zip(padding, caches, strict=True)):
            if cache.keys is None:
                continue
            for stored, own in zip(
                (*batch.keys, *batch.values), (*cache.keys, *cache.values), strict=True
            ):
                stored[row : row + 1, :, pad:] = own[..., : cache.offset, :]
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(part.nbytes for part in (*self.keys, *self.values))


def make_quantized_caches(model: Any, bits: int) -> list[QuantizedSequenceCache]:
    """Fresh per-layer quantized caches for one sequence of `model`.

    Only for models whose every layer keeps a plain KV cache of per-head keys and values: a
    sliding-window or recurrent layer, or a latent (MLA), has no quantized batched form here.
    """
    if bits not in KV_BITS:
        raise EngineError(f"KV cache bits must be one of {KV_BITS}, got {bits}")
    if getattr(model.args, "kv_lora_rank", None):  # deepseek's multi-head latent attention
        raise EngineError(
            "a quantized KV cache needs per-head keys and values; this model caches a "
            "compressed latent (multi-head latent attention): serve it without --kv-bits"
        )
    plain = make_prompt_cache(model)
    if not all(type(cache) is KVCache for cache in plain):
        kinds = sorted({type(cache).__name__ for cache in plain if type(cache) is not KVCache})
        raise EngineError(
            f"a quantized KV cache needs plain KV caches in every layer; this model keeps "
            f"{', '.join(kinds)}: serve it without --kv-bits"
        )
    group_size = kv_group_size(model_head_dim(model))
    return [QuantizedSequenceCache(group_size, bits) for _ in plain]


def model_head_dim(model: Any) -> int:
    """The attention head size of an mlx-lm model, from its arguments."""
    args = model.args
    head_dim = getattr(args, "head_dim", None)
    return int(head_dim or args.hidden_size // args.num_attention_heads)


def as_sequence_cache(cache: Any) -> Any:
    """mlx-lm's QuantizedKVCache (what load_prompt_cache rebuilds) as tandem's own class;
    any other cache as it is."""
    if type(cache) is not QuantizedKVCache:
        return cache
    fresh = QuantizedSequenceCache(cache.group_size, cache.bits)
    fresh.keys, fresh.values, fresh.offset = cache.keys, cache.values, cache.offset
    return fresh


def as_mlx_cache(cache: Any) -> Any:
    """Tandem's class as mlx-lm's own, which save_prompt_cache writes and load finds by name."""
    if type(cache) is not QuantizedSequenceCache:
        return cache
    plain = QuantizedKVCache(cache.group_size, cache.bits)
    plain.keys, plain.values, plain.offset = cache.keys, cache.values, cache.offset
    return plain


def _zeros(shape: tuple[int, ...], head_dim: int, dtype: mx.Dtype, cache: Any) -> Triple:
    """An empty quantized triple for `shape` + (head_dim,) vectors."""
    packed = mx.zeros((*shape, head_dim * cache.bits // 32), dtype=mx.uint32)
    scales = mx.zeros((*shape, head_dim // cache.group_size), dtype=dtype)
    return packed, scales, mx.zeros_like(scales)


def _head_dim(triple: Triple, bits: int) -> int:
    return triple[0].shape[-1] * 32 // bits


def _cut(triple: Triple, start: int, stop: int) -> Triple:
    return tuple(part[..., start:stop, :] for part in triple)


def _joined(old: Triple, more: Triple, used: int) -> Triple:
    return tuple(
        mx.concatenate([a[..., :used, :], b], axis=2) for a, b in zip(old, more, strict=True)
    )


def _aligned(
    cache: QuantizedBatchCache, template: QuantizedBatchCache, filled: int, width: int
) -> tuple[Triple, Triple, mx.array]:
    """cache's triples padded so its filled part ends at `filled`, `width` columns in all,
    and its left padding counted accordingly."""
    keys, values = cache.keys, cache.values
    if keys is None:  # no tokens yet: zero columns, shaped like the template's
        rows = cache.offset.shape[0]
        keys = tuple(mx.zeros((rows, *p.shape[1:2], 0, p.shape[3]), p.dtype) for p in template.keys)
        values = tuple(
            mx.zeros((rows, *p.shape[1:2], 0, p.shape[3]), p.dtype) for p in template.values
        )
    left = filled - cache._idx
    right = width - keys[0].shape[2] - left
    if right < 0:
        keys, values = _cut(keys, 0, right), _cut(values, 0, right)
        right = 0
    if left or right:
        widths = [(0, 0), (0, 0), (left, right), (0, 0)]
        keys = tuple(mx.pad(part, widths) for part in keys)
        values = tuple(mx.pad(part, widths) for part in values)
    return keys, values, cache.left_padding + left
