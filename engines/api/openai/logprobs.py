"""Token log-probabilities in OpenAI's shapes: chat's `content` list, completions' lists."""

from __future__ import annotations

import math
from typing import Any

from engines.api.openai.schemas import ChoiceLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from engines.api.token_score import TokenScore

# JSON has no -Infinity; OpenAI reports a token that cannot be sampled as -9999.0.
FLOOR = -9999.0


def chat_logprobs(tokenizer: Any, scores: list[TokenScore]) -> ChoiceLogprobs:
    content = []
    for score in scores:
        text = _token_text(tokenizer, score.token)
        alternatives = [
            TopLogprob(
                token=(other := _token_text(tokenizer, token)),
                logprob=_finite(value),
                bytes=list(other.encode()),
            )
            for token, value in score.top
        ]
        content.append(
            TokenLogprob(
                token=text,
                logprob=_finite(score.logprob),
                bytes=list(text.encode()),
                top_logprobs=alternatives,
            )
        )
    return ChoiceLogprobs(content=content)


def completion_logprobs(
    tokenizer: Any, scores: list[TokenScore], top: int, start_offset: int = 0
) -> CompletionLogprobs:
    tokens, values, tops, offsets = [], [], [], []
    offset = start_offset
    for score in scores:
        text = _token_text(tokenizer, score.token)
        tokens.append(text)
        values.append(_finite(score.logprob))
        # Two ids may decode to the same text: the first (most likely) one keeps its value.
        alternatives: dict[str, float] = {}
        for token, value in score.top:
            alternatives.setdefault(_token_text(tokenizer, token), _finite(value))
        tops.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=values,
        top_logprobs=tops if top > 0 else None,
        text_offset=offsets,
    )


def _token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token])


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR
