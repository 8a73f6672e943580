"""The coordinator's side of the pipeline's prefix cache: which ending sequences are kept,
keeping them on stage 0 and in the index, and the END frames that tell every stage to keep
or drop its share. An entry the index drops while a sequence not begun yet will start from it
is held until that sequence has begun, so no stage drops what a BEGIN is about to name.
"""

from __future__ import annotations

from collections.abc import Sequence

from engines.pipeline import sequence_documents


class PrefixKeeping:
    """Part of EncryptedPipelineEngine (engine.py), which owns the state these methods use:
    `prefix_index`, stage 0's `_local` batches, the `_schedule`, the `_hits` of sequences not
    begun yet and the entries `_held` for them; END frames go out through its `_send`."""

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
        # An estimate: stage 0's bytes scaled to all layers (the stages' layers are alike).
        scale = self.stage.total_layers / len(self.layers)
        for uid, tokens in keep:
            nbytes = self._local.keep(uid, len(tokens), tokens)
            dropped += self.prefix_index.add(uid, tokens, int(nbytes * scale))
        return self._release(dropped)

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

    def _send_end(
        self, uids: Sequence[int], keep: Sequence[tuple[int, int]], evict: Sequence[int]
    ) -> None:
        """END frames: the first ends `uids` and keeps `keep`; evictions go in bounded lists."""
        size = sequence_documents.MAX_EVICT_PER_END
        chunks = [evict[start : start + size] for start in range(0, len(evict), size)] or [[]]
        for index, chunk in enumerate(chunks):
            ended, kept = (uids, keep) if index == 0 else ((), ())
            self._send(sequence_documents.end_frame(self._take_number(), ended, kept, chunk))

    def _forget_prefix_cache(self) -> None:
        """The session's stages and their entries are gone: forget every entry and hit."""
        self.prefix_index.clear()
        self._held.clear()
        for uid in self._hits:
            if uid in self._schedule:  # not begun yet: it prefills its whole prompt after all
                self._schedule.start_cold(uid)
        self._hits.clear()
