"""Shared prefill on the pipeline: a request whose prompt shares a long prefix with a prompt
still being prefilled waits for that prompt's KV instead of computing the same tokens again
(engines/prefix_cache/shared_prefill.py keeps the books, as on the single engine). When the
owner's first token comes back, every stage keeps the owner's prompt KV as a prefix-cache
entry (an END `share` order: it travels in order with the frames, and no frame running the
owner past its prompt has gone down yet), and the waiting requests are scheduled from it.
"""

from __future__ import annotations

from collections.abc import Sequence

from engines.core.request import GenerationRequest


class SharedPrompts:
    """Part of EncryptedPipelineEngine (engine.py), which owns `_sharing` (a PrefillSharing),
    the `prefix_index`, stage 0's `_local` batches, the `_schedule` and the `_recounted`
    cached tokens a sequence's first output reports; prefix_keeping.py indexes and sends."""

    def _admit(self, uid: int, prompt: Sequence[int]) -> int:
        """Schedule a sequence from its prefix-cache hit (or none); returns the cached tokens."""
        cached = self._schedule_hit(uid, prompt, self.prefix_index.lookup(prompt))
        if self.prefix_index.enabled:
            self._sharing.prefilling(uid, tuple(prompt))
        return cached

    def _let_in(self, waiters: list[tuple[int, GenerationRequest]]) -> None:
        """Waiting requests are scheduled; their first output reports the tokens they reused."""
        for uid, request in waiters:
            self._recounted[uid] = self._admit(uid, request.prompt_tokens)

    def _share_prompts(self, produced: list[tuple[int, int]]) -> None:
        """The owners whose first token just came back keep their prompts for their waiters,
        who then go in (a prefill answer has one row: one owner at most)."""
        done = {uid for uid, _ in produced if self._sharing.first_token(uid)}
        for owner in done:
            self._keep_prompt(owner)
        if done:
            self._let_in(self._sharing.released(done))

    def _keep_prompt(self, owner: int) -> None:
        """Keep the owner's prompt KV as a new entry on stage 0 and in the index, and tell
        every other stage to keep its layers of it."""
        length = self._local.position(owner)  # its prompt: none of its decode frames is out
        tokens = self._schedule.tokens(owner)[:length]
        entry = self._take_entry_id()
        nbytes = self._local.keep(owner, length, tokens, entry=entry)
        evict = self._release(self._index_kept(entry, tokens, nbytes))
        self._local.drop(evict)
        spill = self._spill_on_stage_zero()
        self._send_end([], [], evict, spill, share=[(owner, entry, length)])
