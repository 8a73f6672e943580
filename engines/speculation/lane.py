"""SpeculativeLane: one sequence decoded alone, several tokens per forward pass when its drafts
are right.

Each step feeds the sequence's next token and the tokens drafted after it (prompt lookup) in
one pass, samples every position as decoding one token at a time would (the same logits
processors over the same context, the same draw of a seeded sampler), keeps the drafted
tokens up to the first the model disagrees with, plus the model's own token there, and trims
the rejected positions off the KV cache. For a draft that is a single guess (not a
distribution) this is exactly speculative sampling: every token keeps the model's
distribution, and greedy tokens are those of plain decoding.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache, can_trim_prompt_cache, trim_prompt_cache

from engines.core.engine import StepOutput
from engines.decoding.sampling import Processor, Sampler, draw_each, give_back_draws, sampled
from engines.speculation.draft_length import DraftLength
from engines.speculation.payoff import Payoff
from engines.speculation.prompt_lookup import PromptLookup

Draft = list[int] | mx.array  # a drafter's guesses; an array may still be computing


class Drafter(Protocol):
    """Guesses a sequence's next tokens from the tokens it has so far. `costly`: drafting runs
    a model (its cost is timed against plain decoding; see Payoff)."""

    costly: bool

    def extend(self, tokens: Iterable[int]) -> None: ...

    def draft(self, most: int) -> Draft: ...


DrafterFactory = Callable[[list[int]], Drafter]  # a sequence's tokens so far -> its drafter


@dataclass
class LaneSequence:
    """A sequence in the lane: its caches hold `tokens`; `next_token` was reported and is fed
    next."""

    uid: int
    caches: list[Any]
    tokens: list[int]
    next_token: int
    sampler: Sampler
    processors: list[Processor]
    top_logprobs: int | None
    draft_length: DraftLength
    drafter: Drafter
    planned: Draft | None = None  # the draft made at the end of the last step
    ahead: tuple[mx.array, mx.array] | None = None  # a plain pass launched for the next step


@dataclass
class SpeculationCounts:
    """Tokens drafted, and of those accepted, over the lane's life (for /metrics)."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0


def speculable(caches: list[Any]) -> bool:
    """Whether rejected positions can be taken back off these caches (not a recurrent layer's,
    nor a sliding window already full)."""
    return can_trim_prompt_cache(caches)


def room_to_draft(caches: list[Any]) -> int:
    """How many tokens can be drafted so that a sliding window still holds every fed position
    (and so can still be trimmed): unbounded without one."""
    room = 1 << 30
    for cache in caches:
        if isinstance(cache, RotatingKVCache):
            room = min(room, cache.max_size - cache.offset - 2)
    return max(room, 0)


class SpeculativeLane:
    """Holds at most one sequence (see DecodeBatch: only while it is alone)."""

    def __init__(
        self, model: Any, stream: Any, most_drafted: int, drafter: DrafterFactory = PromptLookup
    ) -> None:
        self.model = model
        self.stream = stream
        self.most_drafted = most_drafted
        self.drafter = drafter
        self.sequence: LaneSequence | None = None
        self.counts = SpeculationCounts()
        self.payoff: Payoff | None = None  # kept across sequences: the pair's costs stay
        self._lap: tuple[float, int, int] | None = None  # the last step: start, drafted, tokens

    def take(
        self,
        uid: int,
        caches: list[Any],
        tokens: list[int],
        sampler: Sampler,
        processors: list[Processor],
        top_logprobs: int | None,
    ) -> None:
        """A sequence from mlx-lm's generator, whose caches hold `tokens` up to its last
        reported token and which has already drawn the token after it: that token is given up
        and drawn again here (the last one is fed again)."""
        trim_prompt_cache(caches, 1)
        give_back_draws(sampler, 1)
        self.sequence = LaneSequence(
            uid, caches, list(tokens[:-1]), tokens[-1], sampler, processors, top_logprobs,
            DraftLength(self.most_drafted), self.drafter(list(tokens)),
        )  # fmt: skip
        self._lap = None
        if self.sequence.drafter.costly:
            self.payoff = self.payoff or Payoff()
            self.payoff.new_sequence()

    def give_back(self) -> LaneSequence:
        """The sequence, to decode elsewhere from its `next_token` on (a pass launched ahead
        is taken back: its position trimmed, its draw given up)."""
        sequence, self.sequence = self.sequence, None
        if sequence.ahead is not None:
            self._take_back(sequence)
        return sequence

    def step(self) -> list[StepOutput]:
        """A verifying pass (the next token and a draft in, one to len(draft) + 1 tokens out),
        or, with nothing to draft, the token of the plain pass launched at the last step. A
        plain pass for the next step is launched before returning, as mlx-lm's generator
        does, so that the model computes while the tokens are reported."""
        sequence, started = self.sequence, time.perf_counter()
        if self._lap is not None and sequence.drafter.costly:
            lap_start, drafted, tokens = self._lap
            self.payoff.record(drafted, started - lap_start, tokens)
        if sequence.ahead is not None:
            outputs, drafted = self._collect(sequence), 0
        else:
            draft = self._draft(sequence)
            outputs, drafted = self._verify(sequence, draft), len(draft)
        self._lap = (started, drafted, len(outputs))
        self.counts.steps += 1
        planned = self._draft(sequence)
        if len(planned):
            sequence.planned = planned
            if not drafted:  # this plain step's lap now holds the drafter catching up
                self._lap = None
        else:
            sequence.ahead = self._forward(sequence, [sequence.next_token])
            mx.async_eval(*sequence.ahead)
        return outputs

    def _draft(self, sequence: LaneSequence) -> Draft:
        if sequence.planned is not None:  # made at the end of the last step
            draft, sequence.planned = sequence.planned, None
            return draft
        if sequence.drafter.costly and not self.payoff.allows():
            return []
        most = min(sequence.draft_length.next(), room_to_draft(sequence.caches))
        return sequence.drafter.draft(most)

    def _forward(self, sequence: LaneSequence, fed: Draft) -> tuple[mx.array, mx.array]:
        """The tokens drawn at each fed position and their log-probabilities, lazily (`fed`
        may be lazy too: a draft model's guesses are computed in the same wait)."""
        with mx.stream(self.stream):
            inputs = fed[None] if isinstance(fed, mx.array) else mx.array([fed])
            logits = self.model(inputs, cache=sequence.caches)[0]
            if sequence.processors:
                logits = processed(logits, sequence.tokens, fed, sequence.processors)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return draw_each(sequence.sampler, logprobs), logprobs

    def _verify(self, sequence: LaneSequence, draft: Draft) -> list[StepOutput]:
        if isinstance(draft, mx.array) and sequence.processors:  # they read the context's ids
            draft = draft.tolist()
        if isinstance(draft, mx.array):
            fed = mx.concatenate([mx.array([sequence.next_token], draft.dtype), draft])
        else:
            fed = [sequence.next_token, *draft]
        drawn, logprobs = self._forward(sequence, fed)
        mx.eval(drawn, logprobs)
        if isinstance(draft, mx.array):
            fed, draft = fed.tolist(), draft.tolist()
        kept = accepted_prefix(drawn.tolist(), draft)
        accepted = len(kept) - 1
        trim_prompt_cache(sequence.caches, len(draft) - accepted)
        give_back_draws(sequence.sampler, len(fed) - len(kept))  # rejected positions' draws
        sequence.draft_length.record(len(draft), accepted)
        self.counts.drafted += len(draft)
        self.counts.accepted += accepted
        outputs = self._advance(sequence, fed[: accepted + 1], kept, logprobs)
        if draft:
            outputs[0] = replace(outputs[0], drafted=len(draft), accepted=accepted)
        return outputs

    def _collect(self, sequence: LaneSequence) -> list[StepOutput]:
        drawn, logprobs = sequence.ahead
        sequence.ahead = None
        mx.eval(drawn, logprobs)
        return self._advance(sequence, [sequence.next_token], drawn.tolist(), logprobs)

    def _advance(
        self, sequence: LaneSequence, cached: list[int], kept: list[int], logprobs: mx.array
    ) -> list[StepOutput]:
        """`cached` are now in the caches, `kept` reported; the last of them is fed next."""
        sequence.tokens.extend(cached)
        sequence.next_token = kept[-1]
        sequence.drafter.extend(kept)
        return [
            sampled(sequence.uid, token, logprobs[i], sequence.top_logprobs)
            for i, token in enumerate(kept)
        ]

    def _take_back(self, sequence: LaneSequence) -> None:
        sequence.ahead = None
        trim_prompt_cache(sequence.caches, 1)
        give_back_draws(sequence.sampler, 1)


def processed(
    logits: mx.array, tokens: list[int], fed: list[int], processors: list[Processor]
) -> mx.array:
    """Each position's logits through the processors, each seeing the tokens before it and
    its own input, as in decoding one token at a time."""
    rows = []
    context = mx.array([*tokens, *fed])
    for i in range(len(fed)):
        row = logits[i : i + 1]
        for processor in processors:
            row = processor(context[: len(tokens) + i + 1], row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)


def accepted_prefix(drawn: list[int], draft: list[int]) -> list[int]:
    """The tokens kept: drawn tokens while they equal the draft, then the first that does not
    (or the one after a draft accepted whole)."""
    kept = []
    for position, token in enumerate(drawn):
        kept.append(token)
        if position >= len(draft) or token != draft[position]:
            break
    return kept
