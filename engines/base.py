"""The Engine interface: what every engine (single, tp, pp) provides and what the API consumes."""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation, engine-agnostic: the same value reaches every engine."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    timeout_s: float = 300.0


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One step of a generation as the API sees it.

    A stream of events ends with exactly one event whose `finish_reason` is set:
    "stop" (EOS or a stop sequence), "length" (max_tokens), "cancelled", or "error"
    (then `error` holds a one-line message). Usage counts ride on the final event.
    """

    text: str = ""
    token: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What /v1/cluster and the startup log say about the running engine."""

    strategy: str  # "single" | "tp" | "pp"
    world_size: int = 1
    detail: dict[str, Any] = field(default_factory=dict)


class Engine(abc.ABC):
    """Produces tokens for one request at a time; the EngineRunner owns threads and queues.

    Lifecycle: `load()` is called once on the runner's worker thread (mlx state is
    per-thread), then `generate_tokens()` once per request on that same thread, then
    `close()`. `generate_tokens` yields token ids until the runner stops iterating
    (EOS, max_tokens, stop sequence, cancel) and closes the generator; it raises
    EngineError when a rank or stage is lost. It must never block without a timeout.
    """

    #: the mlx_lm TokenizerWrapper used for detokenizing and chat templates
    tokenizer: Any

    @abc.abstractmethod
    def load(self) -> None:
        """Load weights (and start any worker processes); called on the worker thread."""

    @abc.abstractmethod
    def generate_tokens(self, request: GenerationRequest) -> Iterator[int]:
        """Yield sampled token ids for `request` (prefill happens before the first yield)."""

    @abc.abstractmethod
    def info(self) -> EngineInfo:
        """Describe the engine for /v1/cluster."""

    def healthy(self) -> bool:
        """False once a rank or stage is lost; /health then reports degraded."""
        return True

    def close(self) -> None:  # noqa: B027 (optional hook: engines without resources skip it)
        """Release weights, worker processes and sockets. Idempotent."""

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)
