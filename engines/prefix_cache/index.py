"""PrefixIndex: which cached token sequences exist, which one a prompt reuses, which to evict.

The index holds no tensors. It is the one place that decides hits and evictions; the KV
itself lives in a `PrefixStore` on every node (a tp rank, a pp stage, or the single
engine), under the same entry id. Entry ids are the uid of the sequence whose cache was
kept, so every node can name an entry without being told a new number.

Two tiers: entries live in memory, bounded by `max_bytes`; with a disk budget, an entry
the memory tier evicts is spilled to disk instead of forgotten (the owner drains
`take_spills()` and tells its stores), and the disk tier has its own LRU bound. A hit on
disk is read back by the stores; the sequence that used it is kept in memory when it ends,
which makes the disk entry (its prefix) redundant.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# A disk hit reads the whole entry back. On the demo models here one read cost as much as
# prefilling 9-29 tokens (entries of 256-4096 tokens; docs/operations.md): a shorter shared
# prefix (a chat template's first tokens) is cheaper to compute than to read.
MIN_DISK_HIT_TOKENS = 32


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Start a new sequence from the first `tokens` tokens of entry `entry_id`."""

    entry_id: int
    tokens: int
    on_disk: bool = False


@dataclass(slots=True)
class PrefixStats:
    """Counters for /v1/cluster and /metrics."""

    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0  # prompt tokens not recomputed thanks to the cache
    prompt_tokens: int = 0  # prompt tokens looked up, hit or miss
    evictions: int = 0
    evicted_bytes: int = 0
    disk_hits: int = 0
    spills: int = 0  # entries moved from memory to disk
    disk_failures: int = 0  # disk hits whose file was torn or corrupt: served as misses


@dataclass(slots=True)
class _Entry:
    tokens: tuple[int, ...]
    nbytes: int


class PrefixIndex:
    """Longest-prefix lookup over cached token sequences, LRU-bounded in bytes.

    `max_bytes` 0 turns the cache off (every lookup misses, nothing is kept).
    `trimmable` says whether a cache can be cut back to a shorter prefix (plain KV caches
    can; sliding-window caches cannot): when it cannot, only an entry that is a whole
    prefix of the prompt is reused. `disk_bytes` > 0 adds the disk tier, whose entries are
    reused for at least `min_disk_hit_tokens` shared tokens.
    """

    def __init__(
        self,
        max_bytes: int,
        trimmable: bool = True,
        disk_bytes: int = 0,
        min_disk_hit_tokens: int = MIN_DISK_HIT_TOKENS,
    ) -> None:
        self.max_bytes = max(max_bytes, 0)
        self.min_disk_hit_tokens = min_disk_hit_tokens
        self.disk_max_bytes = max(disk_bytes, 0) if self.max_bytes else 0
        self.trimmable = trimmable
        self.off_reason = "" if self.max_bytes else "prefix cache budget is 0"
        self.stats = PrefixStats()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._disk: OrderedDict[int, _Entry] = OrderedDict()  # the disk tier, LRU first
        self._disk_bytes = 0
        self._spills: list[int] = []  # moved to disk since the owner last asked

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def turn_off(self, reason: str) -> None:
        """Keep nothing from now on (before any entry exists), and say why in the snapshot."""
        self.max_bytes, self.disk_max_bytes, self.off_reason = 0, 0, reason

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries) + len(self._disk)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._entries or entry_id in self._disk

    def on_disk(self, entry_id: int) -> bool:
        return entry_id in self._disk

    @property
    def spills_pending(self) -> bool:
        return bool(self._spills)

    def take_spills(self) -> list[int]:
        """The entries moved from memory to disk since the last call: every store must now
        write its part of them to disk and let go of the memory."""
        spills, self._spills = self._spills, []
        return spills

    def lookup(self, prompt: tuple[int, ...] | list[int]) -> PrefixHit | None:
        """The entry sharing the longest prefix with `prompt`, or None.

        At least the prompt's last token is always left to compute: its logits start the
        answer. A hit marks the entry as recently used.
        """
        prompt = tuple(prompt)
        self.stats.prompt_tokens += len(prompt)
        best = self.peek(prompt)
        if best is None:
            self.stats.misses += 1
            return None
        (self._disk if best.on_disk else self._entries).move_to_end(best.entry_id)
        self.stats.hits += 1
        self.stats.disk_hits += best.on_disk
        self.stats.hit_tokens += best.tokens
        return best

    def peek(self, prompt: tuple[int, ...]) -> PrefixHit | None:
        """What `lookup` would answer, without counting it or touching the LRU order."""
        best: PrefixHit | None = None
        if self.enabled:  # memory first: on a tie, the entry that needs no read wins
            for tier, on_disk in ((self._entries, False), (self._disk, True)):
                for entry_id, entry in tier.items():
                    shared = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
                    if shared < len(entry.tokens) and not self.trimmable:
                        continue  # the entry cannot be cut back to the shared part
                    if on_disk and shared < self.min_disk_hit_tokens:
                        continue  # reading it back would cost more than it saves
                    if shared > 0 and (best is None or shared > best.tokens):
                        best = PrefixHit(entry_id, shared, on_disk)
        return best

    def add(self, entry_id: int, tokens: tuple[int, ...] | list[int], nbytes: int) -> list[int]:
        """Index a kept cache; returns the entry ids every node must now drop.

        That list may hold `entry_id` itself (cache off, or the entry alone exceeds the
        budgets of memory and of disk; one that fits only on disk goes there), entries the
        new one makes redundant (a trimmable entry that is a prefix of the new one), and
        least recently used entries past the byte budgets.
        """
        tokens = tuple(tokens)
        if not self.enabled or not tokens or nbytes > max(self.max_bytes, self.disk_max_bytes):
            return [entry_id]
        dropped = []
        if self.trimmable:  # a prefix of the new entry is served just as well by it
            dropped = [
                other
                for tier in (self._entries, self._disk)
                for other, entry in tier.items()
                if len(entry.tokens) <= len(tokens) and tokens[: len(entry.tokens)] == entry.tokens
            ]
            for other in dropped:
                self._forget(other)
        if nbytes > self.max_bytes:  # too big for memory, not for disk: straight there
            self._to_disk(entry_id, _Entry(tokens, nbytes))
        else:
            self._entries[entry_id] = _Entry(tokens, nbytes)
            self._bytes += nbytes
        return dropped + self._evict_to(self.max_bytes)

    def restore(self, entry_id: int, tokens: tuple[int, ...], nbytes: int) -> list[int]:
        """List an entry a previous run left on disk (oldest first); returns the ids to drop
        to keep the disk tier's budget (possibly `entry_id`)."""
        if not self.disk_max_bytes:
            return [entry_id]
        self._disk[entry_id] = _Entry(tuple(tokens), nbytes)
        self._disk_bytes += nbytes
        return self._evict_to(self.max_bytes)

    def discard(self, entry_id: int) -> None:
        """Forget one entry whose KV turned out unusable (its file is torn or corrupt)."""
        if entry_id in self:
            self._forget(entry_id)
        self.stats.disk_failures += 1

    def evict(self, keep_fraction: float) -> list[int]:
        """Move least recently used entries out of memory (to disk, with a disk tier) until
        at most `keep_fraction` of the memory tier's bytes remain; returns the ids dropped."""
        keep_fraction = min(max(keep_fraction, 0.0), 1.0)
        return self._evict_to(int(self._bytes * keep_fraction))

    def clear(self) -> list[int]:
        """Forget everything (the nodes holding the KV are gone); returns the ids dropped."""
        dropped = [*self._entries, *self._disk]
        self._entries.clear()
        self._disk.clear()
        self._bytes = self._disk_bytes = 0
        self._spills.clear()
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
            "disk_max_bytes": self.disk_max_bytes,
            "disk_bytes": self._disk_bytes,
            "disk_entries": len(self._disk),
            "disk_hits": stats.disk_hits,
            "spills": stats.spills,
            "disk_failures": stats.disk_failures,
        }

    def _evict_to(self, budget: int) -> list[int]:
        """Memory's least recently used entries past `budget` go to disk (when it has room
        for them) or are dropped; then the disk tier keeps to its own budget."""
        dropped = []
        while self._bytes > budget and self._entries:
            entry_id, entry = self._entries.popitem(last=False)
            self._bytes -= entry.nbytes
            self.stats.evictions += 1
            self.stats.evicted_bytes += entry.nbytes
            if entry.nbytes <= self.disk_max_bytes:
                self._to_disk(entry_id, entry)
            else:
                dropped.append(entry_id)
        while self._disk_bytes > self.disk_max_bytes and self._disk:
            entry_id, entry = self._disk.popitem(last=False)
            self._disk_bytes -= entry.nbytes
            if entry_id in self._spills:  # never written: the stores just drop it
                self._spills.remove(entry_id)
            dropped.append(entry_id)
        return dropped

    def _to_disk(self, entry_id: int, entry: _Entry) -> None:
        self._disk[entry_id] = entry
        self._disk_bytes += entry.nbytes
        self._spills.append(entry_id)
        self.stats.spills += 1

    def _forget(self, entry_id: int) -> None:
        if entry_id in self._entries:
            self._bytes -= self._entries.pop(entry_id).nbytes
        else:
            self._disk_bytes -= self._disk.pop(entry_id).nbytes
            if entry_id in self._spills:
                self._spills.remove(entry_id)


def common_prefix(first: tuple[int, ...], second: tuple[int, ...]) -> int:
    """Length of the longest common prefix, by bisection over C-speed tuple comparisons."""
    low, high = 0, min(len(first), len(second))
    while low < high:
        middle = (low + high + 1) // 2
        if first[:middle] == second[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
