"""A model's KV quantization (--kv-bits, --quantized-kv-start): its fresh caches, caches handed
in (prefix-cache entries, from memory or disk) made of its kind, and mlx-lm's classes for files."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from engines.model.quantized_kv import QuantizedSequenceCache
from errors import EngineError
from planner.memory import KV_BITS, kv_group_size


@dataclass(frozen=True, slots=True)
class KVQuantization:
    """Every sequence's KV cache quantized to `bits` in groups of `group_size`, once a forward
    pass leaves it at `start` tokens or more (mlx-lm's kv_bits, kv_group_size,
    quantized_kv_start)."""

    bits: int
    group_size: int
    start: int
    layers: int  # the model's

    def make_caches(self) -> list[QuantizedSequenceCache]:
        """Fresh caches for one sequence, one per layer."""
        return [
            QuantizedSequenceCache(self.group_size, self.bits, self.start)
            for _ in range(self.layers)
        ]

    def adopt(self, cache: Any) -> QuantizedSequenceCache:
        """A cache handed in as this quantization's: full precision when it is a plain KVCache
        (a disk entry read back under the threshold), quantized when it is quantized."""
        fresh = QuantizedSequenceCache(
            self.group_size, self.bits, self.start, getattr(cache, "quantized", False)
        )
        fresh.keys, fresh.values, fresh.offset = cache.keys, cache.values, cache.offset
        return fresh


def kv_quantization(model: Any, bits: int, start: int) -> KVQuantization:
    """`model`'s KV quantization to `bits` from `start` tokens; EngineError for a model whose
    caches have no quantized batched form here (only plain per-head KV caches do: not a
    sliding-window or recurrent layer, nor a latent (MLA))."""
    if bits not in KV_BITS:
        raise EngineError(f"KV cache bits must be one of {KV_BITS}, got {bits}")
    if start < 0:
        raise EngineError(f"the quantized KV start must be 0 or more tokens, got {start}")
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
    return KVQuantization(bits, kv_group_size(model_head_dim(model)), start, len(plain))


def model_head_dim(model: Any) -> int:
    """The attention head size of an mlx-lm model, from its arguments."""
    args = model.args
    head_dim = getattr(args, "head_dim", None)
    return int(head_dim or args.hidden_size // args.num_attention_heads)


def quantizes_inside(caches: list[Any], count: int) -> bool:
    """Whether mlx-lm would quantize these caches between `count - 1` more tokens and the last
    one: then they cannot take all `count` in one pass and match it."""
    return any(
        isinstance(cache, QuantizedSequenceCache) and cache.quantizes_inside(count)
        for cache in caches
    )


def as_sequence_cache(cache: Any) -> Any:
    """mlx-lm's QuantizedKVCache (what load_prompt_cache rebuilds) as tandem's, quantized (its
    threshold passed: the owner's adopt() gives it the owner's); any other cache as it is."""
    if type(cache) is not QuantizedKVCache:
        return cache
    fresh = QuantizedSequenceCache(cache.group_size, cache.bits, 0, quantized=True)
    fresh.keys, fresh.values, fresh.offset = cache.keys, cache.values, cache.offset
    return fresh


def as_mlx_cache(cache: Any) -> Any:
    """Tandem's class as mlx-lm's own (KVCache under the threshold, QuantizedKVCache past it),
    which save_prompt_cache writes and load_prompt_cache finds by name."""
    if type(cache) is not QuantizedSequenceCache:
        return cache
    plain = QuantizedKVCache(cache.group_size, cache.kv_bits) if cache.quantized else KVCache()
    plain.keys, plain.values, plain.offset = cache.keys, cache.values, cache.offset
    return plain
