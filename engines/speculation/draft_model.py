"""Draft-model drafting (--draft-model): a smaller model with the target's tokenizer guesses the
next tokens greedily, one pass each, and the target checks them in one pass (as mlx_lm.server's
--draft-model). The draft model keeps a KV cache of the sequence's tokens, trimmed back to what
the target accepted. A draft is handed over still computing: the target's pass is built on it,
and one wait covers both (as mlx-lm's speculative step)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from errors import EngineError


class DraftModelDrafter:
    """One sequence's drafts from `model`: `draft` first feeds the tokens its cache lacks (the
    whole prompt, the first time), then decodes greedily; `extend` keeps the drafted positions
    the target accepted and trims the rest."""

    costly = True

    def __init__(self, model: Any, stream: Any, tokens: Iterable[int]) -> None:
        self.model = model
        self.stream = stream
        self.tokens = list(tokens)  # the sequence's known tokens
        self.caches = make_prompt_cache(model)
        self.cached = 0  # how many of `tokens` the caches hold
        # the last draft (computed by the time its verdict comes); all but its last token are
        # in the caches
        self._guesses: mx.array | list[int] = []

    def extend(self, tokens: Iterable[int]) -> None:
        kept = list(tokens)
        fed = list_of(self._guesses)[:-1]  # drafted positions the caches hold after the known
        agreed = 0
        while agreed < min(len(fed), len(kept)) and fed[agreed] == kept[agreed]:
            agreed += 1
        trim_prompt_cache(self.caches, len(fed) - agreed)
        # the agreed positions are now known tokens; with no draft (a step that did not
        # draft) the caches lack `kept`, fed with the next draft
        self.cached += agreed
        self.tokens.extend(kept)
        self._guesses = []

    def draft(self, most: int) -> mx.array | list[int]:
        if most <= 0 or not self.tokens:
            return []
        if len(self._guesses):  # drafted twice without a verdict: the first one is forgotten
            trim_prompt_cache(self.caches, len(self._guesses) - 1)
            self._guesses = []
        with mx.stream(self.stream):
            # each guess is fed to the next pass as it computes; nothing here waits
            pending = mx.array([self.tokens[self.cached :]])
            lazy = []
            for _ in range(most):
                logits = self.model(pending, cache=self.caches)[:, -1, :]
                token = mx.argmax(logits, axis=-1)
                mx.async_eval(token)
                lazy.append(token)
                pending = token[None]
            guesses = mx.concatenate(lazy)
        self.cached = len(self.tokens)
        self._guesses = guesses
        return guesses


def list_of(guesses: mx.array | list[int]) -> list[int]:
    return guesses.tolist() if isinstance(guesses, mx.array) else guesses


def check_draft_model(draft: Any, draft_tokenizer: Any, target_tokenizer: Any) -> None:
    """EngineError unless `draft` can draft for the target: the same vocabulary (token ids
    mean the same text) and a cache that can be trimmed."""
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        differ = sum(1 for text, id_ in target_vocab.items() if draft_vocab.get(text) != id_)
        raise EngineError(
            f"the draft model's tokenizer is not the target's: {len(draft_vocab)} tokens "
            f"against {len(target_vocab)}, {differ} of the target's differ; a draft model must "
            "share the served model's tokenizer"
        )
    if not can_trim_prompt_cache(make_prompt_cache(draft)):
        raise EngineError(
            "the draft model keeps a cache that cannot be trimmed (a recurrent or sliding-window "
            "layer): rejected drafts could not be taken back"
        )
