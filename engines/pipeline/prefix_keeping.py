"""The coordinator's side of the pipeline's prefix cache: which ending sequences are kept,
keeping them on stage 0 and in the index, and the END frames that tell every stage to keep,
drop or spill to disk its share. An entry the index drops while a sequence not begun yet will
start from it is held until that sequence has begun, so no stage drops what a BEGIN is about
to name. A sequence whose entry is on disk waits until every stage has read its share back
(a STATUS roll call with `load`): if one cannot (torn, corrupt, missing), the entry is
forgotten everywhere and the sequence prefills its whole prompt, a miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engines.pipeline import sequence_documents, wire
from engines.pipeline.wire import Kind
from engines.prefix_cache.index import PrefixHit

# Entries not named by a runner uid (shared prompts, entries listed again from disk) take
# ids from here up: runner uids count from 0 and never get there.
PRIVATE_ENTRY_IDS = 2**63


class PrefixKeeping:
    """Part of EncryptedPipelineEngine (engine.py), which owns the state these methods use:
    `prefix_index`, stage 0's `_local` batches, the `_schedule`, the `_hits` of sequences not
    begun yet and the entries `_held` for them, the uids `_verifying` (waiting for a read-back
    roll call), the roll calls out (`_loads`), the `_recounted` cached tokens of sequences
    whose disk entry failed (or who waited for a shared prompt) and the last private entry id
    given (`_last_entry_id`); frames go out through its `_send`."""

    def _schedule_hit(self, uid: int, prompt: Sequence[int], hit: PrefixHit | None) -> int:
        """Schedule a new sequence from its hit (or none); one whose entry is on disk waits
        for every stage to read it back. Returns the cached tokens."""
        if hit is None:
            self._schedule.add(uid, prompt)
            return 0
        self._hits[uid] = hit
        self._schedule.add(uid, prompt, hit.tokens, held=hit.on_disk)
        if hit.on_disk:
            self._verifying.append(uid)
        return hit.tokens

    def _send_loads(self) -> None:
        """A STATUS roll call asking every stage to read back the disk entries the waiting
        sequences begin from; its READY comes back in turn with the other answers."""
        uids = [uid for uid in self._verifying if uid in self._hits]
        self._verifying.clear()
        entries = sorted({self._hits[uid].entry_id for uid in uids})
        if not entries:
            return
        limit = sequence_documents.MAX_EVICT_PER_END
        entries, later = entries[:limit], set(entries[limit:])
        self._verifying = [uid for uid in uids if self._hits[uid].entry_id in later]
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
        failed_entries = set(failed)
        for entry in failed_entries:
            self.prefix_index.discard(entry)  # counted as a disk failure
        for uid, hit in list(self._hits.items()):  # none of them has begun
            if hit.entry_id in failed_entries:
                del self._hits[uid]
                self._schedule.start_cold(uid)
                self._recounted[uid] = 0
        for uid in uids:
            if uid in self._schedule:
                self._schedule.release(uid)
        drop = self._release(sorted(failed_entries))
        if drop:
            self._local.drop(drop)
            self._send_end([], [], drop)

    def _caches_to_keep(self, uids: Sequence[int]) -> list[tuple[int, tuple[int, ...]]]:
        """(uid, the tokens its caches hold) of the ending sequences worth keeping."""
        if not self.prefix_index.enabled:
            return []
        keep = []
        for uid in uids:
            length = self._local.position(uid)  # every stage holds as many once END arrives
            if length > 0:
                keep.append((uid, self._schedule.tokens(uid)[:length]))
        return keep

    def _keep_on_stage_zero(self, keep: list[tuple[int, tuple[int, ...]]]) -> list[int]:
        """Keep the caches here and index them; returns the entries every stage must drop."""
        dropped: list[int] = []
        for uid, tokens in keep:
            dropped += self._index_kept(uid, tokens, self._local.keep(uid, len(tokens), tokens))
        return self._release(dropped)

    def _index_kept(self, entry: int, tokens: tuple[int, ...], nbytes: int) -> list[int]:
        """Index an entry stage 0 holds `nbytes` of; returns the entries the index dropped."""
        return self.prefix_index.add(entry, tokens, self._entry_bytes(len(tokens), nbytes))

    def _entry_bytes(self, tokens: int, nbytes: int) -> int:
        """An entry's bytes over the whole chain, from the `nbytes` stage 0 holds of it: scaled
        to all layers (the stages' layers are alike); a relay, which holds none, counts the
        model's KV per token."""
        if not self.layers:
            return tokens * self._relay_kv_bytes_per_token
        return int(nbytes * self.stage.total_layers / len(self.layers))

    def _take_entry_id(self) -> int:
        """A fresh id for an entry no runner uid names."""
        self._last_entry_id += 1
        return self._last_entry_id

    def _release(self, dropped: list[int]) -> list[int]:
        """Of entries the index dropped, those the stages can drop now; the others are held
        until the sequences that will begin from them have begun."""
        pinned = {hit.entry_id for hit in self._hits.values()}
        self._held.update(entry for entry in dropped if entry in pinned)
        return [entry for entry in dropped if entry not in pinned]

    def _unpin(self, uids: Sequence[int]) -> list[int]:
        """`uids` no longer wait to begin from an entry: the held entries now free to drop."""
        for uid in uids:
            self._hits.pop(uid, None)
        pinned = {hit.entry_id for hit in self._hits.values()}
        free = [entry for entry in self._held if entry not in pinned]
        self._held.difference_update(free)
        return free

    def _spill_on_stage_zero(self) -> list[int]:
        """The entries the index just moved to disk: written here (in the background) and
        returned for every other stage to write its share."""
        spill = self.prefix_index.take_spills()
        self._local.spill(spill)
        return spill

    def _send_end(
        self,
        uids: Sequence[int],
        keep: Sequence[tuple[int, int]],
        evict: Sequence[int],
        spill: Sequence[int] = (),
        share: Sequence[tuple[int, int, int]] = (),
    ) -> None:
        """END frames: the first ends `uids`, keeps `keep` and shares `share`; evictions and
        spills go in bounded lists."""
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
        self.prefix_index.clear()
        self._held.clear()
        self._verifying.clear()
        self._loads.clear()
        for uid in self._hits:
            if uid in self._schedule:  # not begun yet: it prefills its whole prompt after all
                self._schedule.start_cold(uid)
        self._hits.clear()
