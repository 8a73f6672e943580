"""A plain KV cache's first tokens as a cache of the same kind (full precision or quantized):
how the prefix cache hands out an entry, and how the disk tier copies one to write."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache

from engines.model.quantized_kv import QuantizedSequenceCache

PLAIN_KV = (KVCache, QuantizedSequenceCache)  # every token's keys and values, nothing else


def kv_prefix(cache: Any, length: int, own: bool = False) -> Any:
    """A fresh cache holding `cache`'s first `length` tokens: over slices of the same arrays
    (mlx arrays are values, so the fresh cache's writes never reach them), or with `own`, in
    contiguous arrays of its own. Keys and values are arrays, or a quantized cache's triples."""
    if type(cache) is QuantizedSequenceCache:
        fresh = cache.copy_empty()  # quantized or not, as the entry is
    else:
        fresh = KVCache()
    if cache.keys is not None:
        keys, values = tree_map(lambda part: part[..., :length, :], (cache.keys, cache.values))
        if own:
            keys, values = tree_map(mx.contiguous, (keys, values))
        fresh.keys, fresh.values, fresh.offset = keys, values, length
    return fresh
