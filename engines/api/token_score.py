"""TokenScore: one generated token's log-probability and its likeliest alternatives, as the
engine reported them; each dialect writes it in its own shape."""

from __future__ import annotations

from dataclasses import dataclass

from engines.core.engine import TokenEvent, TopLogprobs


@dataclass(frozen=True, slots=True)
class TokenScore:
    """One generated token with its logprob and the most likely alternatives."""

    token: int
    logprob: float
    top: TopLogprobs

    @classmethod
    def of(cls, event: TokenEvent) -> TokenScore | None:
        if event.token is None or event.logprob is None:
            return None
        return cls(event.token, event.logprob, event.top_logprobs)
