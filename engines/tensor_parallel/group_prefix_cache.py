"""GroupPrefixCache: the tp coordinator's side of the prefix cache every rank holds a shard of.

The books (engines/prefix_cache/books.py) decide hits, waiters and what every rank must do
(drop, spill, or keep entries); their orders go out with the next step command. This adds what
only the group needs: the tokens of every sequence, so that an entry the ranks report kept can
be indexed, and the ranks' reports of inserts whose entry a rank could not use.

Entry ids are a kept sequence's uid; entries no sequence names (a running prompt kept for the
requests waiting for it, an entry a previous run left on disk) count down from TOP_ENTRY_ID.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from engines.prefix_cache.books import PrefixBooks
from engines.prefix_cache.index import PrefixHit, PrefixIndex
from engines.tensor_parallel.lockstep import TOP_ENTRY_ID

log = logging.getLogger(__name__)


class GroupPrefixCache:
    """`max_bytes` and `disk_bytes` are the whole group's budgets; every rank holds an equal
    shard of each entry, so an entry's bytes are rank 0's times `world_size`."""

    def __init__(self, max_bytes: int, disk_bytes: int, world_size: int) -> None:
        self.books = PrefixBooks(PrefixIndex(max_bytes, disk_bytes=disk_bytes), TOP_ENTRY_ID)
        self.world_size = world_size
        self._tokens: dict[int, list[int]] = {}  # uid or entry -> its tokens, until kept

    @property
    def index(self) -> PrefixIndex:
        return self.books.index

    def restore(self, stored: Iterable[list[Any]]) -> None:
        """List the entries every rank found on disk ([entry, tokens, bytes on rank 0])."""
        for entry, tokens, rank_bytes in stored:
            self.books.claim_private_id(entry)  # the ranks named it
            self.books.restore(entry, tuple(tokens), rank_bytes * self.world_size)
        if restored := self.index.snapshot()["disk_entries"]:
            log.info("prefix cache: %d entries every rank holds on disk", restored)

    # -- sequences -------------------------------------------------------------------------

    def start(self, uid: int, prompt: tuple[int, ...]) -> PrefixHit | None:
        """`uid` joins the batch now: the entry it starts from, if any."""
        if not self.index.enabled:
            return None
        self._tokens[uid] = list(prompt)
        self.books.prefilling(uid, prompt)
        return self.books.lookup(prompt)

    def sampled(self, uid: int, token: int) -> None:
        if uid in self._tokens:
            self._tokens[uid].append(token)

    def owners_done(self, uids: Iterable[int]) -> set[int]:
        """Of the sequences that sampled a token, those whose prompt others wait for: each now
        gets a keep order for its prompt's KV."""
        owners = self.books.owners_done(uids)
        for owner in owners:
            entry = self.books.take_private_id()
            self._tokens[entry] = list(self._tokens.get(owner, []))
            self.books.order_keep(owner, entry)
        return owners

    def forget(self, uids: Iterable[int], kept: bool = True) -> None:
        """Sequences that left the batch (their tokens stay until the ranks report the entry
        kept, unless `kept` is False) or never reached it."""
        uids = list(uids)
        self.books.forget(uids)
        if not kept:
            for uid in uids:
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
                self.books.order_evict([entry])
                continue
            self.books.index_entry(entry, tokens, rank_bytes * self.world_size)

    def index_missed(self, missed: Iterable[list[int]]) -> None:
        """Inserts that prefilled their whole prompt because a rank could not use their entry
        ([uid, entry]): the entry goes everywhere, and the sequence reused nothing."""
        for uid, entry in missed:
            log.warning("prefix cache: a rank could not use entry %d; prefilled it again", entry)
            if entry in self.index:
                self.books.discard([entry])
            self.books.report_late(uid, 0)

    # -- orders for the ranks ------------------------------------------------------------------

    def take_orders(self) -> dict[str, list[Any]]:
        """The step command's evict, spill and keep lists, handed over once."""
        orders = self.books.take_orders()
        keep = [[owner, entry] for owner, entry in orders.keep]
        return {"evict": orders.evict, "spill": orders.spill, "keep": keep}
