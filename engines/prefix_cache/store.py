"""PrefixStore: one node's share of every prefix-cache entry (its layers, or its tp shard).

The index (engines/prefix_cache/index.py) decides; the store only keeps, hands out and drops.
Handing out never changes the stored entry: a plain KV cache (quantized or not) is re-wrapped
around a slice of the stored arrays (mlx arrays are values, so the new sequence's writes
cannot reach them); any other cache is deep-copied and trimmed. Two conversations branching
from one system prompt therefore both start from the same entry. With a disk tier, `spill`
moves entries out of memory to disk (engines/prefix_cache/disk_tier.py), and a hit reads them
back (or `load` reads one ahead, checking it, for the next `take_prefix`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from engines.prefix_cache.disk_tier import DiskTier, DiskUnreadable
from engines.prefix_cache.kv_prefix import PLAIN_KV, kv_prefix
from errors import EngineError

log = logging.getLogger(__name__)


class PrefixStore:
    """Entry id -> (per-layer caches, the tokens they hold)."""

    def __init__(self, disk: DiskTier | None = None) -> None:
        self._entries: dict[int, tuple[list[Any], tuple[int, ...]]] = {}
        self._loaded: dict[int, tuple[list[Any], tuple[int, ...]]] = {}  # read ahead, for once
        self.disk = disk

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: int) -> bool:
        if entry_id in self._entries or entry_id in self._loaded:
            return True
        return self.disk is not None and entry_id in self.disk

    @property
    def nbytes(self) -> int:
        """Bytes held in memory (the disk tier's are `disk.nbytes`)."""
        return sum(cache_bytes(caches) for caches, _ in self._entries.values())

    def put(self, entry_id: int, caches: list[Any], tokens: Iterable[int]) -> int:
        """Keep a finished sequence's caches; returns their bytes. The arrays are evaluated
        now so that the entry holds memory, not a graph of the batch it came from."""
        mx.eval([cache.state for cache in caches])
        self._entries[entry_id] = (caches, tuple(tokens))
        return cache_bytes(caches)

    def spill(self, entry_ids: Iterable[int]) -> None:
        """Move entries from memory to the disk tier (written in the background); without
        one they are dropped."""
        for entry_id in entry_ids:
            entry = self._entries.pop(entry_id, None)
            if entry is not None and self.disk is not None:
                self.disk.write(entry_id, *entry)

    def load(self, entry_id: int) -> None:
        """Read an entry on disk back now, for the next `take_prefix` of it; DiskUnreadable
        when it is not held or its file is torn or corrupt (the caller makes that a miss)."""
        if entry_id in self._entries or entry_id in self._loaded:
            return
        if self.disk is None or entry_id not in self.disk:
            raise DiskUnreadable(f"prefix-cache entry {entry_id} is not held here")
        self._loaded[entry_id] = self.disk.read(entry_id)

    def take_prefix(self, entry_id: int, length: int) -> tuple[list[Any], list[int]]:
        """Fresh caches holding the entry's first `length` tokens, and those tokens."""
        caches, tokens = self._loaded.pop(entry_id, None) or self._require(entry_id)
        if not 0 < length <= len(tokens):
            raise EngineError(
                f"prefix-cache entry {entry_id} holds {len(tokens)} tokens, asked for {length}"
            )
        if reusable(caches):
            return [kv_prefix(cache, length) for cache in caches], list(tokens[:length])
        fresh = copy.deepcopy(caches)
        if length < len(tokens):
            if not can_trim_prompt_cache(fresh):
                raise EngineError(f"prefix-cache entry {entry_id} cannot be cut back to {length}")
            trim_prompt_cache(fresh, len(tokens) - length)
        return fresh, list(tokens[:length])

    def drop(self, entry_ids: Iterable[int]) -> None:
        for entry_id in entry_ids:
            self._entries.pop(entry_id, None)
            self._loaded.pop(entry_id, None)
            if self.disk is not None:
                self.disk.drop(entry_id)

    def clear(self) -> None:
        self._entries.clear()
        self._loaded.clear()
        if self.disk is not None:
            self.disk.clear()

    def close(self) -> None:
        """Forget everything and remove the disk tier's files."""
        self._entries.clear()
        self._loaded.clear()
        if self.disk is not None:
            self.disk.close()

    def _require(self, entry_id: int) -> tuple[list[Any], tuple[int, ...]]:
        """The entry from memory, or read back from disk (DiskUnreadable: treat as a miss)."""
        entry = self._entries.get(entry_id)
        if entry is not None:
            return entry
        if self.disk is not None and entry_id in self.disk:
            return self.disk.read(entry_id)
        raise EngineError(
            f"prefix-cache entry {entry_id} is not held here: the nodes disagree on the "
            "cache's contents"
        )


def reusable(caches: list[Any]) -> bool:
    """Whether a model's caches can be kept and restarted from: plain KV caches (quantized
    or not) only.

    Sliding-window (rotating) and recurrent caches hold a window or a state, not every
    token's KV, so a prefix of them is not what a fresh prefill of that prefix would give.
    """
    return all(type(cache) in PLAIN_KV for cache in caches)


NOT_REUSABLE = "the model's sliding-window or recurrent caches cannot be reused"


def cache_bytes(caches: list[Any]) -> int:
    return sum(cache.nbytes for cache in caches)
