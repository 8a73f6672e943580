"""GroupPrefixCache: the tp coordinator's books of the prefix cache every rank holds a shard of.

The index decides hits and evictions; `PrefillSharing` holds back requests that wait for a
prompt still being prefilled. What the ranks must do about it (drop, spill, or keep entries)
waits here as orders for the next step command, and what the ranks report back (entries kept,
inserts whose entry a rank could not use) is indexed here.

Entry ids are a kept sequence's uid; entries no sequence names (a running prompt kept for the
requests waiting for it, an entry a previous run left on disk) count down from TOP_ENTRY_ID.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from engines.core.request import GenerationRequest
from engines.prefix_cache.index import PrefixHit, PrefixIndex
from engines.prefix_cache.shared_prefill import PrefillSharing
from engines.tensor_parallel.lockstep import TOP_ENTRY_ID

log = logging.getLogger(__name__)


class GroupPrefixCache:
    """`max_bytes` and `disk_bytes` are the whole group's budgets; every rank holds an equal
    shard of each entry, so an entry's bytes are rank 0's times `world_size`."""

    def __init__(self, max_bytes: int, disk_bytes: int, world_size: int) -> None:
        self.index = PrefixIndex(max_bytes, disk_bytes=disk_bytes)
        self.sharing = PrefillSharing()
        self.world_size = world_size
        self._tokens: dict[int, list[int]] = {}  # uid or entry -> its tokens, until kept
        self._evicts: list[int] = []  # entries every rank drops with the next step
        self._keeps: list[list[int]] = []  # [uid, entry]: prompts every rank keeps
        self._next_private = TOP_ENTRY_ID  # the next id no sequence names
        self._late_cached: dict[int, int] = {}  # uid -> tokens reused, for its first output

    def restore(self, stored: Iterable[list[Any]]) -> None:
        """List the entries every rank found on disk ([entry, tokens, bytes on rank 0])."""
        for entry, tokens, rank_bytes in stored:
            self._next_private = min(self._next_private, entry - 1)
            self._evicts += self.index.restore(entry, tuple(tokens), rank_bytes * self.world_size)
        if restored := self.index.snapshot()["disk_entries"]:
            log.info("prefix cache: %d entries every rank holds on disk", restored)

    # -- sequences -------------------------------------------------------------------------

    def hold(self, uid: int, request: GenerationRequest) -> bool:
        """True when `uid` now waits for a prompt being prefilled (`released` lets it in)."""
        return self.sharing.hold(uid, request, self.index)

    def start(self, uid: int, prompt: tuple[int, ...]) -> PrefixHit | None:
        """`uid` joins the batch now: the entry it starts from, if any."""
        if not self.index.enabled:
            return None
        self._tokens[uid] = list(prompt)
        self.sharing.prefilling(uid, prompt)
        return self.index.lookup(prompt)

    def sampled(self, uid: int, token: int) -> None:
        if uid in self._tokens:
            self._tokens[uid].append(token)

    def owners_done(self, uids: Iterable[int]) -> set[int]:
        """Of the sequences that sampled a token, those whose prompt others wait for: each now
        gets a keep order for its prompt's KV."""
        owners = {uid for uid in uids if self.sharing.first_token(uid)}
        for owner in owners:
            entry, self._next_private = self._next_private, self._next_private - 1
            self._tokens[entry] = list(self._tokens.get(owner, []))
            self._keeps.append([owner, entry])
        return owners

    def released(self, owners_done: set[int] | None = None) -> list[tuple[int, Any]]:
        """Waiters to let in now (see PrefillSharing.released)."""
        return self.sharing.released(owners_done)

    def reused(self, uid: int, cached: int) -> None:
        """A waiter let in late reused `cached` tokens: its first output says so."""
        self._late_cached[uid] = cached

    def late_cached(self, uid: int) -> int | None:
        """The tokens a sequence reused, when its first output must correct what `insert`
        said (it waited, or a rank could not use its entry); asked once per output."""
        return self._late_cached.pop(uid, None)

    def forget(self, uids: Iterable[int], kept: bool = True) -> None:
        """Sequences that left the batch (their tokens stay until the ranks report the entry
        kept, unless `kept` is False) or never reached it."""
        uids = list(uids)
        self.sharing.forget(uids)
        for uid in uids:
            self._late_cached.pop(uid, None)
            if not kept:
                self._tokens.pop(uid, None)

    # -- what the ranks report ---------------------------------------------------------------

    def index_kept(self, kept: Iterable[list[int]]) -> None:
        """Index the entries the ranks kept ([entry, tokens held, bytes on rank 0])."""
        for entry, length, rank_bytes in kept:
            tokens = self._tokens.pop(entry, [])[:length]
            if len(tokens) < length:  # never expected: the ranks hold tokens we never saw
                log.warning(
                    "rank 0 kept %d tokens as entry %d, %d known", length, entry, len(tokens)
                )
                self._evicts.append(entry)
                continue
            self._evicts += self.index.add(entry, tokens, rank_bytes * self.world_size)

    def index_missed(self, missed: Iterable[list[int]]) -> None:
        """Inserts that prefilled their whole prompt because a rank could not use their entry
        ([uid, entry]): the entry goes everywhere, and the sequence reused nothing."""
        for uid, entry in missed:
            log.warning("prefix cache: a rank could not use entry %d; prefilled it again", entry)
            if entry in self.index:
                self.index.discard(entry)
                self._evicts.append(entry)
            self._late_cached[uid] = 0

    # -- orders for the ranks ------------------------------------------------------------------

    def evict(self, keep_fraction: float) -> int:
        """Memory pressure: the index moves entries out of memory; returns the bytes freed."""
        before = self.index.nbytes
        self._evicts += self.index.evict(keep_fraction)
        return before - self.index.nbytes

    @property
    def orders_pending(self) -> bool:
        return bool(self._evicts or self._keeps or self.index.spills_pending)

    def take_orders(self) -> dict[str, list[Any]]:
        """The step command's evict, spill and keep lists, handed over once."""
        orders = {"evict": self._evicts, "spill": self.index.take_spills(), "keep": self._keeps}
        self._evicts, self._keeps = [], []
        return orders

    def snapshot(self) -> dict[str, Any]:
        return {**self.index.snapshot(), "shared_prefills": self.sharing.shared}
