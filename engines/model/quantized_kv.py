"""Quantized KV caches as mlx-lm's generate_step keeps them, made to batch: one sequence's, and a
left-padded batch of them (mlx-lm 0.32.2 has none, so mlx_lm.server with --kv-bits does not
batch).

mlx-lm quantizes a sequence's cache (every token it holds, and each one after) once a forward
pass, a prefill chunk or a decode step, leaves it at least `quantized_kv_start` tokens
(maybe_quantize_kv_cache, which runs after each pass): until then, and within the pass that
crosses the threshold, attention reads full-precision keys and values. These caches do the
same, deferring the conversion to the start of the next pass (the same values: mx.quantize
treats each token alone) or to when the cache is taken out whole.

Quantized keys and values are mx.quantize triples (packed uint32, scales, biases), each
(B, kv_heads, T, ·). mlx-lm's attention reads them when the cache has `bits`, so `bits`
exists only while every row is quantized; a batch whose rows straddle the threshold attends
in full precision over its quantized rows dequantized (mlx-lm has no such batch to match).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll

from planner.memory import quantizes_at

Triple = tuple[mx.array, mx.array, mx.array]  # packed (·, D*bits/32), scales, biases (·, D/g)


class QuantizedSequenceCache(KVCache):
    """One sequence's KV: full precision (KVCache's arrays) until a pass leaves it at `start`
    tokens or more, then every token quantized to `kv_bits` (triples)."""

    def __init__(self, group_size: int, kv_bits: int, start: int, quantized: bool = False):
        super().__init__()
        self.group_size, self.kv_bits, self.start = group_size, kv_bits, start
        self.quantized = quantized

    @property
    def bits(self) -> int:
        # mlx-lm attends over quantized K/V when hasattr(cache, "bits"): only once quantized
        if not self.quantized:
            raise AttributeError("bits: this cache still holds full-precision keys and values")
        return self.kv_bits

    def settle(self) -> None:
        """Quantize what it holds when the last pass left it at the threshold or past it."""
        if self.quantized or not quantizes_at(self.offset, self.start):
            return
        if self.keys is not None:
            self.keys = self._quantize(self.keys[..., : self.offset, :])
            self.values = self._quantize(self.values[..., : self.offset, :])
        self.quantized = True

    def quantizes_inside(self, count: int) -> bool:
        """Whether mlx-lm would quantize this cache between the first `count - 1` of `count`
        more tokens and the last one (it prefills a prompt but its last token, then that one)."""
        return (
            not self.quantized and count > 1 and quantizes_at(self.offset + count - 1, self.start)
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        self.settle()
        if not self.quantized:
            return super().update_and_fetch(keys, values)
        start, count = self.offset, keys.shape[2]  # keys, values: (1, kv_heads, count, D)
        if self.keys is None or start + count > self.keys[0].shape[2]:
            steps = (count + self.step - 1) // self.step * self.step
            more = [
                zeros((*k.shape[:2], steps), k.shape[-1], k.dtype, self) for k in (keys, values)
            ]
            if self.keys is None:
                self.keys, self.values = more
            else:
                self.keys = joined(self.keys, more[0], start)
                self.values = joined(self.values, more[1], start)
        for stored, new in zip(
            (*self.keys, *self.values),
            (*self._quantize(keys), *self._quantize(values)),
            strict=True,
        ):
            stored[..., start : start + count, :] = new
        self.offset += count
        return self.keys_and_values()

    def keys_and_values(self) -> Any:
        if not self.quantized:
            return super().keys_and_values()
        return cut(self.keys, 0, self.offset), cut(self.values, 0, self.offset)

    @property
    def state(self) -> Any:
        if self.keys is None:
            return None, None, self.offset
        keys, values = self.keys_and_values()
        return keys, values, self.offset

    @state.setter
    def state(self, value: Any) -> None:
        self.keys, self.values, self.offset = value

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in _parts(self.keys, self.values))

    def _quantize(self, array: mx.array) -> Triple:
        return tuple(mx.quantize(array, group_size=self.group_size, bits=self.kv_bits))

    def copy_empty(self) -> QuantizedSequenceCache:
        """A cache with this one's settings and state of quantization, holding nothing."""
        return QuantizedSequenceCache(self.group_size, self.kv_bits, self.start, self.quantized)

    @classmethod
    def merge(cls, caches: list[Any]) -> QuantizedBatchCache:
        return QuantizedBatchCache.merge(caches)


class QuantizedBatchCache(BatchKVCache):
    """A left-padded batch of QuantizedSequenceCache rows, each full precision or quantized.

    BatchKVCache's layout (`left_padding`, `offset` per row, `_idx` the filled length) over two
    stores of the same T columns: `keys`/`values` (F, kv_heads, T, D) the full-precision rows,
    `qkeys`/`qvalues` (Q, kv_heads, T, ·) the quantized ones, each in batch order. `quantized`
    and `lengths` (each row's tokens, right padding not counted) are Python lists: no sync.
    """

    def __init__(self, left_padding: list[int], group_size: int, kv_bits: int, start: int):
        super().__init__(left_padding)
        self.group_size, self.kv_bits, self.start = group_size, kv_bits, start
        self.quantized = [False] * len(left_padding)
        self.lengths = [0] * len(left_padding)
        self.qkeys: Triple | None = None
        self.qvalues: Triple | None = None
        self._unfilled: list[int] | None = None  # tokens per row still to come in this prefill

    @property
    def bits(self) -> int:
        # mlx-lm attends over quantized K/V when hasattr(cache, "bits"): only when all rows are
        if not self.quantized or not all(self.quantized):
            raise AttributeError("bits: rows of this batch hold full-precision keys and values")
        return self.kv_bits

    def rows(self) -> tuple[list[int], list[int]]:
        """The batch's full-precision rows and its quantized rows, in batch order."""
        full = [row for row, done in enumerate(self.quantized) if not done]
        return full, [row for row, done in enumerate(self.quantized) if done]

    def settle(self) -> None:
        """Quantize every full-precision row the last pass left at the threshold or past it."""
        due = [
            row
            for row, (done, length) in enumerate(zip(self.quantized, self.lengths, strict=True))
            if not done and quantizes_at(length, self.start)
        ]
        if not due:
            return
        full, quantized = self.rows()
        for row in due:
            self.quantized[row] = True
        if self.keys is None:
            return
        moving = _index([full.index(row) for row in due])
        staying = _index([index for index, row in enumerate(full) if row not in due])
        order = _index(_argsort(quantized + due))  # the quantized rows back in batch order
        self.qkeys = tuple(
            mx.concatenate([old, new])[order]
            for old, new in zip(self.qkeys, self._quantize(self.keys[moving]), strict=True)
        )
        self.qvalues = tuple(
            mx.concatenate([old, new])[order]
            for old, new in zip(self.qvalues, self._quantize(self.values[moving]), strict=True)
        )
        self.keys, self.values = self.keys[staying], self.values[staying]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        self.settle()
        start, count = self._idx, keys.shape[2]  # keys, values: (B, kv_heads, count, D)
        if self.keys is None or start + count > self.keys.shape[2]:
            self._grow(keys, values, count)
        full, quantized = self.rows()
        if full:
            chosen = slice(None) if not quantized else mx.array(full)
            self.keys[..., start : start + count, :] = keys[chosen]
            self.values[..., start : start + count, :] = values[chosen]
        if quantized:
            chosen = slice(None) if not full else mx.array(quantized)
            for stored, new in zip(
                (*self.qkeys, *self.qvalues),
                (*self._quantize(keys[chosen]), *self._quantize(values[chosen])),
                strict=True,
            ):
                stored[..., start : start + count, :] = new
        self.offset = self.offset + count
        self._idx += count
        self._count(count)
        return self.keys_and_values()

    def _count(self, count: int) -> None:
        if self._unfilled is None:
            self.lengths = [length + count for length in self.lengths]
            return
        taken = [min(count, left) for left in self._unfilled]  # right padding is not a token
        self.lengths = [length + took for length, took in zip(self.lengths, taken, strict=True)]
        self._unfilled = [left - took for left, took in zip(self._unfilled, taken, strict=True)]

    def _grow(self, keys: mx.array, values: mx.array, count: int) -> None:
        """Room for `count` more tokens in both stores, in whole steps (as mlx-lm's caches)."""
        steps = (count + self.step - 1) // self.step * self.step
        full, quantized = self.rows()
        heads = keys.shape[1]
        more_keys = mx.zeros((len(full), heads, steps, keys.shape[-1]), keys.dtype)
        more_values = mx.zeros((len(full), heads, steps, values.shape[-1]), values.dtype)
        more_qkeys = zeros((len(quantized), heads, steps), keys.shape[-1], keys.dtype, self)
        more_qvalues = zeros((len(quantized), heads, steps), values.shape[-1], values.dtype, self)
        if self.keys is None:
            self.keys, self.values = more_keys, more_values
            self.qkeys, self.qvalues = more_qkeys, more_qvalues
            return
        used = self._idx
        self.keys = mx.concatenate([self.keys[..., :used, :], more_keys], axis=2)
        self.values = mx.concatenate([self.values[..., :used, :], more_values], axis=2)
        self.qkeys = joined(self.qkeys, more_qkeys, used)
        self.qvalues = joined(self.qvalues, more_qvalues, used)

    def keys_and_values(self) -> Any:
        full, quantized = self.rows()
        keys, values = self.keys[..., : self._idx, :], self.values[..., : self._idx, :]
        if not quantized:
            return keys, values
        qkeys, qvalues = cut(self.qkeys, 0, self._idx), cut(self.qvalues, 0, self._idx)
        if not full:
            return qkeys, qvalues
        order = mx.array(_argsort(full + quantized))  # (B,): rows back in batch order
        keys = mx.concatenate([keys, self._dequantize(qkeys, keys.dtype)])[order]
        values = mx.concatenate([values, self._dequantize(qvalues, values.dtype)])[order]
        return keys, values

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)
        if self._right_padding is not None:
            self._unfilled = list(lengths)

    def finalize(self) -> None:
        """After a right-padded prefill: roll each row's padding to its left."""
        self._unfilled = None
        if self._right_padding is None:
            return
        padding = self._right_padding
        full, quantized = self.rows()
        if self.keys is not None:
            shifts = padding[mx.array(full)][:, None] if full else None
            qshifts = padding[mx.array(quantized)][:, None] if quantized else None
            if full:
                self.keys = dynamic_roll(self.keys, shifts, axis=2)
                self.values = dynamic_roll(self.values, shifts, axis=2)
            if quantized:
                self.qkeys = tuple(dynamic_roll(part, qshifts, axis=2) for part in self.qkeys)
                self.qvalues = tuple(dynamic_roll(part, qshifts, axis=2) for part in self.qvalues)
        self.offset = self.offset - padding
        self.left_padding = self.left_padding + padding
        self._right_padding = None

    def filter(self, batch_indices: list[int]) -> None:
        """Keep these rows, then drop the padding columns every remaining row shares."""
        full, quantized = self.rows()
        if self.keys is not None:
            # each store's rows in the new batch order
            kept_full = _index([full.index(row) for row in batch_indices if row in full])
            kept_quantized = _index(
                [quantized.index(row) for row in batch_indices if row in quantized]
            )
            self.keys, self.values = self.keys[kept_full], self.values[kept_full]
            self.qkeys = tuple(part[kept_quantized] for part in self.qkeys)
            self.qvalues = tuple(part[kept_quantized] for part in self.qvalues)
        indices = mx.array(batch_indices)
        self.quantized = [self.quantized[row] for row in batch_indices]
        self.lengths = [self.lengths[row] for row in batch_indices]
        if self._unfilled is not None:
            self._unfilled = [self._unfilled[row] for row in batch_indices]
        self.offset = self.offset[indices]
        self.left_padding = self.left_padding[indices]
        shared = min(self.left_padding.tolist())
        if shared > 0:
            if self.keys is not None:
                self._trim_left(shared)
            self._idx -= shared
            self.left_padding = self.left_padding - shared

    def _trim_left(self, columns: int) -> None:
        self.keys, self.values = self.keys[..., columns:, :], self.values[..., columns:, :]
        self.qkeys = cut(self.qkeys, columns, None)
        self.qvalues = cut(self.qvalues, columns, None)

    def extend(self, other: QuantizedBatchCache) -> None:
        """Append other's rows, both right-aligned at the longer filled length."""
        if self.keys is not None or other.keys is not None:
            filled = max(self._idx, other._idx)
            width = max(c.keys.shape[2] for c in (self, other) if c.keys is not None)
            template = self if self.keys is not None else other
            mine, theirs = (_aligned(c, template, filled, width) for c in (self, other))
            self.keys = mx.concatenate([mine[0], theirs[0]])
            self.values = mx.concatenate([mine[1], theirs[1]])
            self.qkeys = tuple(
                mx.concatenate(pair) for pair in zip(mine[2], theirs[2], strict=True)
            )
            self.qvalues = tuple(
                mx.concatenate(pair) for pair in zip(mine[3], theirs[3], strict=True)
            )
            self.left_padding = mx.concatenate([mine[4], theirs[4]])
            self._idx = filled
        else:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
        self.offset = mx.concatenate([self.offset, other.offset])
        self.quantized = self.quantized + other.quantized
        self.lengths = self.lengths + other.lengths

    def extract(self, idx: int) -> QuantizedSequenceCache:
        """Row `idx` alone, without its padding, in arrays of its own (quantized when due)."""
        padding = self.left_padding.tolist()[idx]
        cache = QuantizedSequenceCache(self.group_size, self.kv_bits, self.start)
        cache.quantized = self.quantized[idx]
        if self.keys is not None:
            full, quantized = self.rows()
            if cache.quantized:
                at = quantized.index(idx)
                rows = slice(at, at + 1)
                cache.keys = tuple(
                    mx.contiguous(part[rows, :, padding : self._idx]) for part in self.qkeys
                )
                cache.values = tuple(
                    mx.contiguous(part[rows, :, padding : self._idx]) for part in self.qvalues
                )
            else:
                at = full.index(idx)
                cache.keys = mx.contiguous(self.keys[at : at + 1, :, padding : self._idx])
                cache.values = mx.contiguous(self.values[at : at + 1, :, padding : self._idx])
        cache.offset = self._idx - padding
        cache.settle()
        return cache

    @classmethod
    def merge(cls, caches: list[Any]) -> QuantizedBatchCache:
        """One batch from single sequences, each right-aligned (left-padded)."""
        for cache in caches:
            cache.settle()
        first = caches[0]
        lengths = [cache.size() for cache in caches]
        longest = max(lengths)
        padding = [longest - length for length in lengths]
        batch = cls(padding, first.group_size, first.kv_bits, first.start)
        batch.quantized = [cache.quantized for cache in caches]
        batch.lengths = lengths
        if longest == 0:
            return batch
        full, quantized = batch.rows()
        sample_full = next((caches[row] for row in full if caches[row].keys is not None), None)
        sample = sample_full or caches[quantized[0]]
        heads = (sample.keys if sample_full else sample.keys[0]).shape[1]
        dtype = sample.keys.dtype if sample_full else sample.keys[1].dtype
        key_dim, value_dim = _head_dims(sample)
        batch.keys = mx.zeros((len(full), heads, longest, key_dim), dtype)
        batch.values = mx.zeros((len(full), heads, longest, value_dim), dtype)
        batch.qkeys = zeros((len(quantized), heads, longest), key_dim, dtype, batch)
        batch.qvalues = zeros((len(quantized), heads, longest), value_dim, dtype, batch)
        for at, row in enumerate(full):
            cache, pad = caches[row], padding[row]
            if cache.keys is not None:
                batch.keys[at : at + 1, :, pad:] = cache.keys[..., : cache.offset, :]
                batch.values[at : at + 1, :, pad:] = cache.values[..., : cache.offset, :]
        for at, row in enumerate(quantized):
            cache, pad = caches[row], padding[row]
            for stored, own in zip(
                (*batch.qkeys, *batch.qvalues), (*cache.keys, *cache.values), strict=True
            ):
                stored[at : at + 1, :, pad:] = own[..., : cache.offset, :]
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    @property
    def state(self) -> Any:
        return self.keys, self.values, self.qkeys, self.qvalues, self.offset, self.left_padding

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in _parts(self.keys, self.values, self.qkeys, self.qvalues))

    def trim(self, n: int) -> int:
        n = super().trim(n)
        self.lengths = [max(0, length - n) for length in self.lengths]
        return n

    def _quantize(self, array: mx.array) -> Triple:
        return tuple(mx.quantize(array, group_size=self.group_size, bits=self.kv_bits))

    def _dequantize(self, triple: Triple, dtype: mx.Dtype) -> mx.array:
        array = mx.dequantize(*triple, group_size=self.group_size, bits=self.kv_bits)
        return array.astype(dtype)


def zeros(shape: tuple[int, ...], head_dim: int, dtype: mx.Dtype, cache: Any) -> Triple:
    """An empty quantized triple for `shape` + (head_dim,) vectors."""
    packed = mx.zeros((*shape, head_dim * cache.kv_bits // 32), dtype=mx.uint32)
    scales = mx.zeros((*shape, head_dim // cache.group_size), dtype=dtype)
    return packed, scales, mx.zeros_like(scales)


def cut(triple: Triple, start: int, stop: int | None) -> Triple:
    return tuple(part[..., start:stop, :] for part in triple)


def joined(old: Triple, more: Triple, used: int) -> Triple:
    return tuple(
        mx.concatenate([a[..., :used, :], b], axis=2) for a, b in zip(old, more, strict=True)
    )


def _parts(*stores: Any) -> list[mx.array]:
    return [part for store in stores if store is not None for part in tree_leaves(store)]


def tree_leaves(store: Any) -> list[mx.array]:
    return list(store) if isinstance(store, tuple) else [store]


def _index(rows: list[int]) -> mx.array:
    return mx.array(rows, dtype=mx.int32)  # (an empty list would make a float array)


def _argsort(rows: list[int]) -> list[int]:
    return sorted(range(len(rows)), key=rows.__getitem__)


def _head_dims(cache: QuantizedSequenceCache) -> tuple[int, int]:
    if not cache.quantized:
        return cache.keys.shape[-1], cache.values.shape[-1]
    per_word = 32 // cache.kv_bits
    return cache.keys[0].shape[-1] * per_word, cache.values[0].shape[-1] * per_word


def _aligned(cache: QuantizedBatchCache, template: QuantizedBatchCache, filled: int, width: int):
    """cache's stores padded so their filled part ends at `filled`, `width` columns in all,
    and its left padding counted accordingly."""
    if cache.keys is None:  # no tokens yet: zero columns, shaped like the template's
        full, quantized = cache.rows()

        def empty(part: mx.array, count: int) -> mx.array:
            return mx.zeros((count, part.shape[1], 0, part.shape[3]), part.dtype)

        keys, values = empty(template.keys, len(full)), empty(template.values, len(full))
        qkeys = tuple(empty(part, len(quantized)) for part in template.qkeys)
        qvalues = tuple(empty(part, len(quantized)) for part in template.qvalues)
    else:
        keys, values, qkeys, qvalues = cache.keys, cache.values, cache.qkeys, cache.qvalues
    left = filled - cache._idx
    right = width - keys.shape[2] - left
    stores = [keys, values, *qkeys, *qvalues]
    if right < 0:
        stores = [part[..., :right, :] for part in stores]
        right = 0
    if left or right:
        stores = [mx.pad(part, [(0, 0), (0, 0), (left, right), (0, 0)]) for part in stores]
    return stores[0], stores[1], tuple(stores[2:5]), tuple(stores[5:8]), cache.left_padding + left
