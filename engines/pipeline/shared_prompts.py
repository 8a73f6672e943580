"""Shared prefill on the pipeline: a request whose prompt shares a long prefix with a prompt
still being prefilled waits for that prompt's KV instead of computing the same tokens again
(engines/prefix_cache/books.py keeps the books, as on the other engines). When the
owner's first token comes back, every stage keeps the owner's prompt KV as a prefix-cache
entry (an END `share` order: it travels in order with the frames, and no frame running the
owner past its prompt has gone down yet), and the waiting requests are scheduled from it.
"""

from __future__ import annotations

from collections.abc import Sequence

from engines.core.request import GenerationRequest


class SharedPrompts:
    """Part of EncryptedPipelineEngine (engine.py), which owns the prefix cache's `books`,
    stage 0's `_local` batches and the `_schedule`; prefix_keeping.py indexes and sends."""

    def _admit(self, uid: int, prompt: Sequence[int]) -> int:
        """Schedule a sequence from its prefix-cache hit (or none); returns the cached tokens."""
        cached = self._schedule_hit(uid, prompt, self.books.lookup(prompt))
        self.books.prefilling(uid, tuple(prompt))
        return cached

    def _let_in(self, waiters: list[tuple[int, GenerationRequest]]) -> None:
        """Waiting requests are scheduled; their first output reports the tokens they reused."""
        for uid, request in waiters:
            self.books.report_late(uid, self._admit(uid, request.prompt_tokens))

    def _share_prompts(self, produced: list[tuple[int, int]]) -> None:
        """The owners whose first token just came back keep their prompts for their waiters,
        who then go in (a prefill answer has one row: one owner at most)."""
        done = self.books.owners_done(uid for uid, _ in produced)
        for owner in done:
            self._keep_prompt(owner)
        if done:
            self._let_in(self.books.released(done))

    def _keep_prompt(self, owner: int) -> None:
        """Keep the owner's prompt KV as a new entry on stage 0 and in the index, and tell
        every other stage to keep its layers of it."""
        length = self._local.position(owner)  # its prompt: none of its decode frames is out
        tokens = self._schedule.tokens(owner)[:length]
        entry = self.books.take_private_id()
        self._index_kept(entry, tokens, self._local.keep(owner, length, tokens, entry=entry))
        self._send_end(self._orders_on_stage_zero(), share=[(owner, entry, length)])
