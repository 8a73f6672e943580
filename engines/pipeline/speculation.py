"""The coordinator's prompt-lookup speculation: what a pipeline sequence decoding alone drafts.

A lone sequence's decode frame may carry its next token and a draft (schedule.py); the last
stage samples every position with the draw it has in plain decoding, the coordinator keeps the
drafted tokens the model agrees with, and every stage trims the rest (batches.py). Only a
sequence the last stage merely samples speculates: penalties, a grammar and logprobs would
need each position's own context there, which a verifying pass does not carry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict
from typing import Any

from engines.core.request import GenerationRequest
from engines.pipeline.stage_session import scores
from engines.pipeline.wire import MAX_VERIFIED
from engines.speculation.draft_length import DraftLength
from engines.speculation.lane import (
    Drafter,
    DrafterFactory,
    SpeculationCounts,
    speculable,
)
from engines.speculation.prompt_lookup import PromptLookup


class PipelineSpeculation:
    """Per sequence, its drafter (fed with its prompt and every token answered) and draft
    length; the counts over the session's life. `most_drafted` 0: off."""

    def __init__(self, most_drafted: int, drafter: DrafterFactory = PromptLookup) -> None:
        self.most_drafted = min(most_drafted, MAX_VERIFIED - 1)  # a frame's positions
        self.drafter = drafter
        self.counts = SpeculationCounts()
        self.possible = most_drafted > 0  # until the model's caches say otherwise
        self._drafters: dict[int, Drafter | None] = {}  # None: a sequence that never drafts
        self._lengths: dict[int, DraftLength] = {}

    def check_model(self, caches: list[Any], windows: Sequence[int | None], kv_bits: int) -> None:
        """Off for caches whose positions cannot be taken back: sliding windows anywhere in
        the chain (one fills up), recurrent layers, quantized KV (as the single engine)."""
        windowed = any(window is not None for window in windows)
        if kv_bits or windowed or not speculable(caches):
            self.possible = False

    def draft(
        self, uid: int, request: GenerationRequest, tokens: Sequence[int], room: int
    ) -> list[int]:
        """The draft of lone sequence `uid` whose prompt and answered tokens are `tokens`;
        at most `room` tokens (what max_tokens leaves after its next one)."""
        if not self.possible:
            return []
        if uid not in self._drafters:  # its first step alone
            self._drafters[uid] = None if scores(request) else self.drafter(list(tokens))
            self._lengths[uid] = DraftLength(self.most_drafted)
        drafter = self._drafters[uid]
        if drafter is None:
            return []
        self.counts.steps += 1
        return drafter.draft(min(self._lengths[uid].next(), room))

    def verified(self, uid: int, drafted: int, accepted: int) -> None:
        self._lengths[uid].record(drafted, accepted)
        self.counts.drafted += drafted
        self.counts.accepted += accepted

    def answered(self, uid: int, tokens: Iterable[int]) -> None:
        """Tokens answered for `uid`, which its drafter (if it has one yet) looks up next."""
        drafter = self._drafters.get(uid)
        if drafter is not None:
            drafter.extend(tokens)

    def forget(self, uids: Iterable[int]) -> None:
        for uid in uids:
            self._drafters.pop(uid, None)
            self._lengths.pop(uid, None)

    def clear(self) -> None:
        self._drafters.clear()
        self._lengths.clear()

    def snapshot(self) -> dict[str, int] | None:
        """For info()'s detail (the /metrics counters); None while off."""
        if not self.most_drafted:
            return None
        return {"most_drafted": self.most_drafted, **asdict(self.counts)}
