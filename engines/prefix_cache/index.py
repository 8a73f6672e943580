"""PrefixIndex: which cached token sequences exist, which one a prompt reuses, which to evict.

The index holds no tensors. It is the one place that decides hits and evictions; the KV
itself lives in a `PrefixStore` on every node (a tp rank, a pp stage, or the single
engine), under the same entry id. Entry ids are the uid of the sequence whose cache was
kept, so every node can name an entry without being told a new number.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Start a new sequence from the first `tokens` tokens of entry `entry_id`."""

    entry_id: int
    tokens: int


@dataclass(slots=True)
class PrefixStats:
    """Counters for /v1/cluster and /metrics."""

    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0  # prompt tokens not recomputed thanks to the cache
    prompt_tokens: int = 0  # prompt tokens looked up, hit or miss
    evictions: int = 0
    evicted_bytes: int = 0


@dataclass(slots=True)
class _Entry:
    tokens: tuple[int, ...]
    nbytes: int


class PrefixIndex:
    """Longest-prefix lookup over cached token sequences, LRU-bounded in bytes.

    `max_bytes` 0 turns the cache off (every lookup misses, nothing is kept).
    `trimmable` says whether a cache can be cut back to a shorter prefix (plain KV caches
    can; sliding-window caches cannot): when it cannot, only an entry that is a whole
    prefix of the prompt is reused.
    """

    def __init__(self, max_bytes: int, trimmable: bool = True) -> None:
        self.max_bytes = max(max_bytes, 0)
        self.trimmable = trimmable
        self.off_reason = "" if self.max_bytes else "prefix cache budget is 0"
        self.stats = PrefixStats()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def turn_off(self, reason: str) -> None:
        """Keep nothing from now on (before any entry exists), and say why in the snapshot."""
        self.max_bytes, self.off_reason = 0, reason

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._entries

    def lookup(self, prompt: tuple[int, ...] | list[int]) -> PrefixHit | None:
        """The entry sharing the longest prefix with `prompt`, or None.

        At least the prompt's last token is always left to compute: its logits start the
        answer. A hit marks the entry as recently used.
        """
        prompt = tuple(prompt)
        self.stats.prompt_tokens += len(prompt)
        best: PrefixHit | None = None
        if self.enabled:
            for entry_id, entry in self._entries.items():
                shared = min(_common_prefix(entry.tokens, prompt), len(prompt) - 1)
                if shared < len(entry.tokens) and not self.trimmable:
                    continue  # the entry cannot be cut back to the shared part
                if shared > 0 and (best is None or shared > best.tokens):
                    best = PrefixHit(entry_id, shared)
        if best is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(best.entry_id)
        self.stats.hits += 1
        self.stats.hit_tokens += best.tokens
        return best

    def add(self, entry_id: int, tokens: tuple[int, ...] | list[int], nbytes: int) -> list[int]:
        """Index a kept cache; returns the entry ids every node must now drop.

        That list may hold `entry_id` itself (cache off, or the entry alone exceeds the
        budget), entries the new one makes redundant (a trimmable entry that is a prefix
        of the new one), and least recently used entries past the byte budget.
        """
        tokens = tuple(tokens)
        if not self.enabled or not tokens or nbytes > self.max_bytes:
            return [entry_id]
        dropped = []
        if self.trimmable:  # a prefix of the new entry is served just as well by it
            dropped = [
                other
                for other, entry in self._entries.items()
                if len(entry.tokens) <= len(tokens) and tokens[: len(entry.tokens)] == entry.tokens
            ]
            for other in dropped:
                self._forget(other)
        self._entries[entry_id] = _Entry(tokens, nbytes)
        self._bytes += nbytes
        return dropped + self._evict_to(self.max_bytes)

    def evict(self, keep_fraction: float) -> list[int]:
        """Drop least recently used entries until at most `keep_fraction` of the bytes remain."""
        keep_fraction = min(max(keep_fraction, 0.0), 1.0)
        return self._evict_to(int(self._bytes * keep_fraction))

    def clear(self) -> list[int]:
        """Forget everything (the nodes holding the KV are gone); returns the ids dropped."""
        dropped = list(self._entries)
        self._entries.clear()
        self._bytes = 0
        return dropped

    def snapshot(self) -> dict[str, int]:
        """The numbers /v1/cluster and /metrics show."""
        stats = self.stats
        return {
            "max_bytes": self.max_bytes,
            "bytes": self._bytes,
            "entries": len(self._entries),
            "hits": stats.hits,
            "misses": stats.misses,
            "hit_tokens": stats.hit_tokens,
            "prompt_tokens": stats.prompt_tokens,
            "evictions": stats.evictions,
            "evicted_bytes": stats.evicted_bytes,
            "off_reason": self.off_reason,
        }

    def _evict_to(self, budget: int) -> list[int]:
        evicted = []
        while self._bytes > budget and self._entries:
            entry_id = next(iter(self._entries))
            self.stats.evictions += 1
            self.stats.evicted_bytes += self._entries[entry_id].nbytes
            self._forget(entry_id)
            evicted.append(entry_id)
        return evicted

    def _forget(self, entry_id: int) -> None:
        self._bytes -= self._entries.pop(entry_id).nbytes


def _common_prefix(first: tuple[int, ...], second: tuple[int, ...]) -> int:
    """Length of the longest common prefix, by bisection over C-speed tuple comparisons."""
    low, high = 0, min(len(first), len(second))
    while low < high:
        middle = (low + high + 1) // 2
        if first[:middle] == second[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
