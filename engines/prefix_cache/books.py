"""PrefixBooks: a coordinator's whole account of its prefix cache, and the orders it gives.

Every engine (single, tensor-parallel, pipeline) keeps the same books: which entry a new
sequence starts from (the index's hit), which requests wait for a prompt still being
prefilled (PrefillSharing), how many tokens a sequence reused when its first output must say
so later (it waited, or its entry turned out unusable), the ids of entries no sequence names,
and what every node must do about the index's decisions: drop entries, spill them to disk,
keep a running prompt. The books decide; each engine carries the orders out: on its own
store (single), in the next step command (tensor-parallel), or in END frames (pipeline).

A hit can be pinned (the pipeline, where a sequence begins frames after its insert): an entry
the index drops while a pinned sequence has not begun from it is held back from the drop
orders until that sequence has begun.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from engines.prefix_cache.index import PrefixHit, PrefixIndex
from engines.prefix_cache.shared_prefill import PrefillSharing


@dataclass(frozen=True, slots=True)
class PrefixOrders:
    """What every node holding a share of the cache must do, in this order."""

    evict: list[int]  # entries to drop
    spill: list[int]  # entries to move from memory to disk
    keep: list[tuple[int, int]]  # (owner uid, entry): keep a running prompt's KV as entry

    def __bool__(self) -> bool:
        return bool(self.evict or self.spill or self.keep)


class PrefixBooks:
    """Hits, waiters, late counts, private ids and pending orders of one prefix cache.

    Entry ids are the uid of the sequence whose cache was kept; entries no sequence names (a
    prompt kept for its waiters, an entry a previous run left on disk) take private ids
    counting down from `top_private_id`, which the engine picks where its uids never reach.
    """

    def __init__(
        self, index: PrefixIndex, top_private_id: int, sharing: PrefillSharing | None = None
    ) -> None:
        self.index = index
        self.sharing = sharing if sharing is not None else PrefillSharing()
        self._next_private = top_private_id
        self._late_cached: dict[int, int] = {}  # uid -> tokens reused, for its first output
        self._pins: dict[int, PrefixHit] = {}  # uid -> the hit it has not begun from yet
        self._held: set[int] = set()  # entries dropped by the index while pinned
        self._evicts: list[int] = []
        self._keeps: list[tuple[int, int]] = []

    # -- sequences -------------------------------------------------------------------------

    def hold(self, uid: int, request: Any) -> bool:
        """True when `uid` now waits for a prompt being prefilled (`released` lets it in)."""
        return self.sharing.hold(uid, request, self.index)

    def lookup(self, prompt: tuple[int, ...] | list[int]) -> PrefixHit | None:
        """The entry a new sequence starts from, if any (counted in the index's stats)."""
        return self.index.lookup(prompt)

    def prefilling(self, uid: int, prompt: tuple[int, ...]) -> None:
        """`uid` prefills `prompt` over the next steps: later requests may wait for it."""
        if self.index.enabled:
            self.sharing.prefilling(uid, prompt)

    def owners_done(self, uids: Iterable[int]) -> set[int]:
        """Of the sequences that produced a token, those whose prompt others wait for: the
        engine keeps each one's prompt KV (under a `take_private_id`) before `released`."""
        return {uid for uid in uids if self.sharing.first_token(uid)}

    def released(self, owners_done: set[int] | None = None) -> list[tuple[int, Any]]:
        """Waiters to let in now (see PrefillSharing.released)."""
        return self.sharing.released(owners_done)

    def report_late(self, uid: int, cached: int) -> None:
        """`uid` reused `cached` tokens after all: its first output says so, not `insert`."""
        self._late_cached[uid] = cached

    def late_cached(self, uid: int) -> int | None:
        """The correction a sequence's output carries, handed out once (None: nothing)."""
        return self._late_cached.pop(uid, None)

    @property
    def any_late(self) -> bool:
        return bool(self._late_cached)

    def forget(self, uids: Iterable[int]) -> None:
        """Sequences removed from the batch (finished, cancelled) or never let in; entries
        held for them are ordered dropped."""
        uids = list(uids)
        self.sharing.forget(uids)
        for uid in uids:
            self._late_cached.pop(uid, None)
        self.begun(uids)

    def clear_waiters(self) -> None:
        self.sharing.clear()

    # -- pinned hits (a sequence that begins later than its insert) -------------------------

    def pin(self, uid: int, hit: PrefixHit) -> None:
        """`uid` will begin from `hit`: its entry stays on every node until it has."""
        self._pins[uid] = hit

    def pinned(self, uid: int) -> PrefixHit | None:
        return self._pins.get(uid)

    def pinned_uids(self) -> list[int]:
        return list(self._pins)

    def begun(self, uids: Iterable[int]) -> None:
        """`uids` no longer wait to begin from an entry: held entries now free are ordered
        dropped."""
        for uid in uids:
            self._pins.pop(uid, None)
        entries = self._pinned_entries()
        free = [entry for entry in self._held if entry not in entries]
        self._held.difference_update(free)
        self._evicts += free

    # -- entry ids -------------------------------------------------------------------------

    def take_private_id(self) -> int:
        """A fresh id for an entry no sequence names."""
        entry, self._next_private = self._next_private, self._next_private - 1
        return entry

    def claim_private_id(self, entry: int) -> None:
        """Another node named an entry `entry` (a disk entry a rank listed): give no id above."""
        self._next_private = min(self._next_private, entry - 1)

    # -- the index's decisions, turned into orders -------------------------------------------

    def worth_keeping(self, length: int) -> bool:
        """Whether a sequence ending with caches over `length` tokens becomes an entry."""
        return self.index.enabled and length > 0

    def index_entry(self, entry: int, tokens: tuple[int, ...] | list[int], nbytes: int) -> None:
        """Index an entry the nodes now hold (`nbytes` over all of them); order the drops."""
        self._order_drops(self.index.add(entry, tokens, nbytes))

    def order_keep(self, owner: int, entry: int) -> None:
        """Every other node keeps running `owner`'s prompt KV as `entry`."""
        self._keeps.append((owner, entry))

    def restore(self, entry: int, tokens: tuple[int, ...], nbytes: int) -> None:
        """List an entry a previous run left on disk; order the drops past the disk budget."""
        self._order_drops(self.index.restore(entry, tokens, nbytes))

    def discard(self, entries: Iterable[int]) -> list[int]:
        """Entries whose KV is unusable somewhere (torn, corrupt, missing; each counted as a
        disk failure): dropped everywhere. Returns the uids pinned to them, which now begin
        from nothing."""
        entries = sorted(set(entries))
        for entry in entries:
            self.index.discard(entry)
        unusable = set(entries)
        cold = [uid for uid, hit in self._pins.items() if hit.entry_id in unusable]
        for uid in cold:
            del self._pins[uid]
        self._order_drops(entries)
        return cold

    def order_evict(self, entries: Iterable[int]) -> None:
        """Drop entries the index never held (a node kept what the books cannot name)."""
        self._evicts += entries

    def evict(self, keep_fraction: float) -> int:
        """Memory pressure: the index moves entries out of memory; returns the bytes freed."""
        before = self.index.nbytes
        self._order_drops(self.index.evict(keep_fraction))
        return before - self.index.nbytes

    @property
    def orders_pending(self) -> bool:
        return bool(self._evicts or self._keeps or self.index.spills_pending)

    def take_orders(self) -> PrefixOrders:
        """The drop, spill and keep orders since the last call, handed over once."""
        orders = PrefixOrders(self._evicts, self.index.take_spills(), self._keeps)
        self._evicts, self._keeps = [], []
        return orders

    def clear(self) -> list[int]:
        """The nodes holding the KV are gone: forget every entry, pin and order; returns the
        uids that were pinned (they have not begun: they prefill their whole prompt)."""
        cold = list(self._pins)
        self.index.clear()
        self._pins.clear()
        self._held.clear()
        self._evicts, self._keeps = [], []
        return cold

    def snapshot(self) -> dict[str, Any]:
        """The numbers /v1/cluster and /metrics show."""
        return {**self.index.snapshot(), "shared_prefills": self.sharing.shared}

    def _order_drops(self, dropped: list[int]) -> None:
        """Order the index's drops, but hold back those a pinned sequence will begin from."""
        entries = self._pinned_entries()
        self._held.update(entry for entry in dropped if entry in entries)
        self._evicts += [entry for entry in dropped if entry not in entries]

    def _pinned_entries(self) -> set[int]:
        return {hit.entry_id for hit in self._pins.values()}
