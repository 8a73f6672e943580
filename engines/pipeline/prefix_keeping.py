"""The coordinator's side of the pipeline's prefix cache: keeping ending sequences on stage 0
and in the books (engines/prefix_cache/books.py, which decide), and the END frames that carry
the books' orders to every stage: keep, drop or spill to disk its share. A new sequence's hit
is pinned in the books until its BEGIN has gone down, so no stage drops what a BEGIN is about
to name. A sequence whose entry is on disk waits until every stage has read its share back
(a STATUS roll call with `load`): if one cannot (torn, corrupt, missing), the entry is
forgotten everywhere and the sequence prefills its whole prompt, a miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engines.pipeline import sequence_documents, wire
from engines.pipeline.wire import Kind
from engines.prefix_cache.books import PrefixOrders
from engines.prefix_cache.index import PrefixHit

# Entries not named by a runner uid (shared prompts, entries listed again from disk) take
# ids from the largest a frame carries down: runner uids count from 0 and never get there.
TOP_PRIVATE_ENTRY_ID = sequence_documents.MAX_UID


class PrefixKeeping:
    """Part of EncryptedPipelineEngine (engine.py), which owns the state these methods use:
    the prefix cache's `books`, stage 0's `_local` batches, the `_schedule`, the uids
    `_verifying` (waiting for a read-back roll call) and the roll calls out (`_loads`); frames
    go out through its `_send`."""

    def _schedule_hit(self, uid: int, prompt: Sequence[int], hit: PrefixHit | None) -> int:
        """Schedule a new sequence from its hit (or none); one whose entry is on disk waits
        for every stage to read it back. Returns the cached tokens."""
        if hit is None:
            self._schedule.add(uid, prompt)
            return 0
        self.books.pin(uid, hit)
        self._schedule.add(uid, prompt, hit.tokens, held=hit.on_disk)
        if hit.on_disk:
            self._verifying.append(uid)
        return hit.tokens

    def _send_loads(self) -> None:
        """A STATUS roll call asking every stage to read back the disk entries the waiting
        sequences begin from; its READY comes back in turn with the other answers."""
        uids = [uid for uid in self._verifying if self.books.pinned(uid) is not None]
        self._verifying.clear()
        entry_of = {uid: self.books.pinned(uid).entry_id for uid in uids}
        entries = sorted(set(entry_of.values()))
        if not entries:
            return
        limit = sequence_documents.MAX_EVICT_PER_END
        entries, later = entries[:limit], set(entries[limit:])
        self._verifying = [uid for uid in uids if entry_of[uid] in later]
        uids = [uid for uid in uids if uid not in self._verifying]
        unreadable = self._local.load(entries)
        number = self._take_number()
        document = {"reports": [self._local_report()], "load": entries}
        self._send(wire.document_frame(Kind.STATUS, number, document))
        self._awaiting.append(wire.Frame(Kind.READY, number))
        self._loads[number] = (uids, unreadable)

    def _loaded(self, number: int, reports: Any) -> None:
        """A read-back roll call answered: the sequences whose entry every stage holds go;
        an entry any stage could not read is forgotten, and its sequences start cold."""
        uids, failed = self._loads.pop(number)
        for report in reports if isinstance(reports, list) else []:
            listed = report.get("unreadable", []) if isinstance(report, dict) else []
            failed += [entry for entry in listed if isinstance(entry, int)]
        for uid in self.books.discard(failed):  # pinned to a failed entry: not begun yet
            self._schedule.start_cold(uid)
            self.books.report_late(uid, 0)
        for uid in uids:
            if uid in self._schedule:
                self._schedule.release(uid)
        orders = self._orders_on_stage_zero()
        if orders:
            self._send_end(orders)

    def _caches_to_keep(self, uids: Sequence[int]) -> list[tuple[int, tuple[int, ...]]]:
        """(uid, the tokens its caches hold) of the ending sequences worth keeping."""
        if not self.books.index.enabled:
            return []
        keep = []
        for uid in uids:
            length = self._local.position(uid)  # every stage holds as many once END arrives
            if self.books.worth_keeping(length):
                keep.append((uid, self._schedule.tokens(uid)[:length]))
        return keep

    def _keep_on_stage_zero(self, keep: list[tuple[int, tuple[int, ...]]]) -> None:
        """Keep the caches here and index them (the books order what every stage drops)."""
        for uid, tokens in keep:
            self._index_kept(uid, tokens, self._local.keep(uid, len(tokens), tokens))

    def _index_kept(self, entry: int, tokens: tuple[int, ...], nbytes: int) -> None:
        """Index an entry stage 0 holds `nbytes` of."""
        self.books.index_entry(entry, tokens, self._entry_bytes(len(tokens), nbytes))

    def _entry_bytes(self, tokens: int, nbytes: int) -> int:
        """An entry's bytes over the whole chain, from the `nbytes` stage 0 holds of it: scaled
        to all layers (the stages' layers are alike); a relay, which holds none, counts the
        model's KV per token."""
        if not self.layers:
            return tokens * self._relay_kv_bytes_per_token
        return int(nbytes * self.stage.total_layers / len(self.layers))

    def _orders_on_stage_zero(self) -> PrefixOrders:
        """Take the books' orders and carry them out here: drop entries, then spill them to
        disk (written in the background); every other stage gets them by `_send_end`."""
        orders = self.books.take_orders()
        self._local.drop(orders.evict)
        self._local.spill(orders.spill)
        return orders

    def _send_end(
        self,
        orders: PrefixOrders,
        uids: Sequence[int] = (),
        keep: Sequence[tuple[int, int]] = (),
        share: Sequence[tuple[int, int, int]] = (),
    ) -> None:
        """END frames: the first ends `uids`, keeps `keep` and shares `share`; the orders'
        evictions and spills go in bounded lists."""
        evict, spill = orders.evict, orders.spill
        size = sequence_documents.MAX_EVICT_PER_END
        count = max(len(evict), len(spill), 1)
        for index, start in enumerate(range(0, count, size)):
            ended, kept, shared = (uids, keep, share) if index == 0 else ((), (), ())
            frame = sequence_documents.end_frame(
                self._take_number(), ended, kept, evict[start : start + size],
                spill[start : start + size], shared,
            )  # fmt: skip
            self._send(frame)

    def _forget_prefix_cache(self) -> None:
        """The session's stages and their entries are gone: forget every entry and hit."""
        self._verifying.clear()
        self._loads.clear()
        for uid in self.books.clear():
            if uid in self._schedule:  # not begun yet: it prefills its whole prompt after all
                self._schedule.start_cold(uid)
