"""Constrained decoding: an llguidance grammar as one request's mlx logits processor."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np

from errors import EngineError

log = logging.getLogger(__name__)

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


class GrammarCompiler:
    """Turns grammars into logits processors for one model's tokenizer and logits width.

    Building llguidance's view of the tokenizer takes a moment on a large vocabulary, so it
    is made once, on first use, and shared by every request.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiled: Any = None

    def prepare(self) -> None:
        """Build llguidance's view of the tokenizer now rather than in the first constrained
        request's step (a pipeline stage must not stall mid-session)."""
        self._llg_tokenizer()

    def processor(self, grammar: str) -> LogitsProcessor:
        """A fresh processor for one sequence (it keeps that sequence's parser state)."""
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise EngineError(f"the output grammar is invalid: {matcher.get_error()}")
        return GrammarProcessor(matcher, self._vocab_size, sorted(self._tokenizer.eos_token_ids))

    def _llg_tokenizer(self) -> Any:
        if self._compiled is None:
            hf_tokenizer = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
            self._compiled = llguidance.hf.from_tokenizer(
                hf_tokenizer,
                n_vocab=self._vocab_size,
                eos_token=sorted(self._tokenizer.eos_token_ids),
            )
        return self._compiled


class GrammarProcessor:
    """mlx-lm's processor protocol, `(tokens so far, logits (1, V)) -> logits`: every token the
    grammar does not allow next gets -inf.

    mlx-lm passes the prompt and the generated tokens; the first call fixes where the prompt
    ends, and each later call feeds the grammar the tokens sampled since.
    """

    def __init__(self, matcher: Any, vocab_size: int, eos: list[int]) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._eos = eos
        self._prompt_length: int | None = None
        self._consumed = 0
        self._failed = False

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._prompt_length is None:
            self._prompt_length = len(tokens)
        fresh = tokens[self._prompt_length + self._consumed :].tolist()
        self._consumed += len(fresh)
        for token in fresh:
            if not self._failed and not self._matcher.consume_token(token):
                self._failed = True
                log.warning("the grammar refused a sampled token: %s", self._matcher.get_error())
        return mx.where(self._allowed(logits.shape[-1]), logits, -mx.inf)

    def _allowed(self, width: int) -> mx.array:
        if self._failed or self._matcher.is_error():
            allowed = np.zeros(width, dtype=bool)  # end the sequence rather than wander off
            allowed[self._eos] = True
            return mx.array(allowed)
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:width].astype(bool)
        if allowed.size < width:  # logits wider than the grammar's vocabulary: padding ids
            allowed = np.pad(allowed, (0, width - allowed.size))
        return mx.array(allowed)
