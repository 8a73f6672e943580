"""Prompt-lookup drafting: the tokens that followed the latest earlier occurrence of the
sequence's last few tokens, in its own prompt and output. An answer that quotes, repeats or
edits its context writes next what followed there; vLLM and llama.cpp call this n-gram
speculation."""

from __future__ import annotations

from collections.abc import Iterable

LONGEST_NGRAM = 4  # the longest match tried first: the most specific context
SHORTEST_NGRAM = 2  # a single token matches too often to be worth checking


class PromptLookup:
    """A sequence's tokens so far, indexed by every n-gram (n from SHORTEST_NGRAM to
    LONGEST_NGRAM) that something followed: `draft` is a dictionary lookup per n, and
    `extend` costs a few per token."""

    costly = False

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self._follower: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest follower is
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            position = len(self.tokens)  # of this token, which now follows the n-grams before it
            self.tokens.append(token)
            for n in range(SHORTEST_NGRAM, min(LONGEST_NGRAM, position) + 1):
                self._follower[tuple(self.tokens[position - n : position])] = position

    def draft(self, most: int) -> list[int]:
        """Up to `most` tokens that followed the latest earlier occurrence of the longest of
        the last n-grams seen before; [] when none was."""
        if most <= 0:
            return []
        for n in range(min(LONGEST_NGRAM, len(self.tokens)), SHORTEST_NGRAM - 1, -1):
            start = self._follower.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start : start + most]
        return []


class TimedPromptLookup(PromptLookup):
    """Prompt lookup whose verifying passes cost more than plain ones: through tandem's CPU
    kernel a pass's work grows with its rows (9 rows cost ~5x one), so drafting is timed
    against plain decoding as a draft model's is (Payoff). Only for an engine that decides
    alone: tensor-parallel ranks must draft alike, by the tokens."""

    costly = True
