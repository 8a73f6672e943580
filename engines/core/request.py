"""GenerationRequest: one generation's prompt and sampling, with its limits, its one check and
its one serialisation — the API builds it, and it crosses to tp ranks and pipeline stages as
its document."""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from typing import Any

from errors import RequestError

MAX_REQUEST_ID_CHARS = 128
MAX_TOKEN_ID = 2**31 - 1  # token ids and counts cross the tp lockstep in int32 words
MAX_TOKENS = 2**31 - 1
MAX_TEMPERATURE = 2.0  # OpenAI's bound
MAX_SEED = 2**53  # the largest integer every JSON client reads exactly (a double)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]
MIN_REPETITION_PENALTY = 0.01  # mlx-lm's multiplicative penalty; None turns it off
MAX_REPETITION_PENALTY = 10.0
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat
MAX_TOP_K = 2**31 - 1  # 0 turns top-k off (vLLM's -1 is refused: one spelling for off)
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256  # each stop sequence; held-back text is bounded by the longest


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation, engine-agnostic: the same value reaches every engine, rank and stage.

    Construct it, then `check()` it (the API does); `from_document` checks what it decodes.
    """

    request_id: str
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # sample among the k most likely tokens; 0: all
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0: off
    stop: tuple[str, ...] = ()
    seed: int | None = None
    timeout_s: float = 300.0
    # mlx-lm's logits processors; None / 0 turn each off
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: off; k >= 0: the token's logprob and the top k others
    grammar: str | None = None  # an llguidance grammar (JSON) the output must match; None: free

    def check(self) -> GenerationRequest:
        """Raise RequestError naming the first field out of its limits; otherwise return self."""
        limits = (
            ("request_id", _is_text(self.request_id, MAX_REQUEST_ID_CHARS),
             f"a text of 1 to {MAX_REQUEST_ID_CHARS} characters"),
            ("prompt_tokens", _are_token_ids(self.prompt_tokens),
             f"a non-empty tuple of token ids in [0, {MAX_TOKEN_ID}]"),
            ("max_tokens", _is_integer(self.max_tokens, 1, MAX_TOKENS),
             f"an integer in [1, {MAX_TOKENS}]"),
            ("temperature", _is_number(self.temperature, 0.0, MAX_TEMPERATURE),
             f"a number in [0, {MAX_TEMPERATURE:g}]"),
            ("top_p", _is_number(self.top_p, 0.0, 1.0) and self.top_p > 0, "a number in (0, 1]"),
            ("top_k", _is_integer(self.top_k, 0, MAX_TOP_K), f"an integer in [0, {MAX_TOP_K}]"),
            ("min_p", _is_number(self.min_p, 0.0, 1.0), "a number in [0, 1]"),
            ("stop", _are_stop_texts(self.stop),
             f"a tuple of at most {MAX_STOP_SEQUENCES} texts of at most {MAX_STOP_CHARS} "
             "characters each"),
            ("seed", self.seed is None or _is_integer(self.seed, 0, MAX_SEED),
             f"null or an integer in [0, {MAX_SEED}]"),
            ("timeout_s", _is_number(self.timeout_s, 0.0, math.inf) and self.timeout_s > 0,
             "a positive number of seconds"),
            ("repetition_penalty", self.repetition_penalty is None
             or _is_number(self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
             f"null or a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]"),
            ("presence_penalty", _is_number(self.presence_penalty, -MAX_PENALTY, MAX_PENALTY),
             f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"),
            ("frequency_penalty", _is_number(self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY),
             f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"),
            ("logprobs", self.logprobs is None or _is_integer(self.logprobs, 0, MAX_TOP_LOGPROBS),
             f"null or an integer in [0, {MAX_TOP_LOGPROBS}]"),
            ("grammar", self.grammar is None or _is_text(self.grammar, None),
             "null or a non-empty text"),
        )  # fmt: skip
        for name, within, expected in limits:
            if not within:
                raise RequestError(name, getattr(self, name), expected)
        return self

    def document(self) -> dict[str, Any]:
        """The request as a JSON object: the one form in which it crosses a process boundary."""
        return {
            field.name: _plain(getattr(self, field.name)) for field in fields(GenerationRequest)
        }

    @classmethod
    def from_document(cls, document: Any) -> GenerationRequest:
        """The request a `document()` describes, checked (RequestError when it is not one)."""
        if not isinstance(document, dict):
            raise RequestError("request", document, "a JSON object")
        known = {field.name: field for field in fields(GenerationRequest)}
        for name in document:
            if name not in known:
                raise RequestError(str(name), document[name], "absent (not a request field)")
        for name, field in known.items():
            if name not in document and field.default is MISSING:
                raise RequestError(name, None, "present")
        values = {
            name: tuple(value) if isinstance(value, list) else value
            for name, value in document.items()
        }
        return cls(**values).check()


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _is_integer(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: Any, low: float, high: float) -> bool:
    """A finite int or float in [low, high] (JSON true / false are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return (isinstance(value, int) or math.isfinite(value)) and low <= value <= high


def _is_text(value: Any, max_chars: int | None) -> bool:
    return isinstance(value, str) and 0 < len(value) <= (max_chars or len(value))


def _are_token_ids(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) > 0
        and all(_is_integer(token, 0, MAX_TOKEN_ID) for token in value)
    )


def _are_stop_texts(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) <= MAX_STOP_SEQUENCES
        and all(isinstance(text, str) and len(text) <= MAX_STOP_CHARS for text in value)
    )
