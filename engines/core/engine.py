"""The Engine interface: a batch of sequences advanced one step at a time, for every engine."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from engines.core.request import GenerationRequest

DEFAULT_PREFILL_CHUNK = 256  # prompt tokens per step: bounds how long a newcomer stalls others


TopLogprobs = tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


class Finish(StrEnum):
    """Why a generation ended: the final event's `finish_reason` (a str, as OpenAI spells it)."""

    STOP = "stop"  # EOS, or a stop sequence (then the event's `stop_sequence` names it)
    LENGTH = "length"  # max_tokens
    CANCELLED = "cancelled"  # the client went away, or asked
    ERROR = "error"  # see the event's `failure` and `error`

    @property
    def natural(self) -> bool:
        """The model ended it (its text is whole), not a cancel or an error."""
        return self in (Finish.STOP, Finish.LENGTH)


class Failure(StrEnum):
    """What kind of error ended a generation (finish ERROR)."""

    ENGINE = "engine"  # the engine, a rank or a stage failed it, or the server shut down
    TIMEOUT = "timeout"  # the request's own deadline passed


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One step of a generation as the API sees it.

    A stream of events ends with exactly one event whose `finish_reason` is set (a
    `Finish`); an ERROR carries its `failure` kind and a one-line `error` message. Usage
    counts ride on the final event.
    """

    text: str = ""
    token: int | None = None
    logprob: float | None = None  # only when the request asked for logprobs
    top_logprobs: TopLogprobs = ()
    finish_reason: Finish | None = None
    error: str | None = None
    failure: Failure | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, not recomputed
    drafted_tokens: int = 0  # speculative decoding: tokens drafted for the model to check ...
    accepted_tokens: int = 0  # ... and those it accepted (each one decoding pass saved)
    stop_sequence: str | None = None  # the stop string that ended a STOP (None: EOS)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step produced for one sequence: a sampled token, or why it was refused."""

    uid: int
    token: int | None = None
    error: str | None = None  # set when the engine refused or dropped this sequence alone
    logprob: float | None = None  # only for a sequence that asked for logprobs
    top_logprobs: TopLogprobs = ()
    # On a sequence's first output only, when insert() could not say yet (it returned 0
    # and the sequence waited before joining the batch): its prompt tokens from the cache.
    cached_tokens: int | None = None
    # On the first output of a speculative pass (engines/speculation/lane.py): the tokens it
    # drafted, and how many of them the model accepted (the outputs after this one).
    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What /v1/cluster and the startup log say about the running engine."""

    strategy: str  # "single" | "tp" | "pp"
    world_size: int = 1
    detail: dict[str, Any] = field(default_factory=dict)


class Engine(abc.ABC):
    """A batch of sequences, advanced together; the scheduler (engines/core/runner.py) drives it.

    Lifecycle: `load()` once on the scheduler's thread (mlx state is per-thread), then any
    interleaving of `insert()`, `remove()` and `step()` on that same thread, then `close()`.
    A sequence joins with `insert(uid, request)` and is prefilled (in chunks) over the
    following steps; each `step()` returns at most one StepOutput per active sequence (none
    for a sequence still prefilling). `remove(uids)` drops sequences at once (finished,
    cancelled, timed out); unknown uids are ignored. `step()` raises EngineError when a rank
    or stage is lost: every sequence in the batch is then gone. Nothing blocks without a
    timeout.
    """

    #: the mlx_lm TokenizerWrapper used for detokenizing and chat templates
    tokenizer: Any
    #: what the engine honours beyond temperature/top_p/seed: "penalties", "logprobs",
    #: "grammar" (GenerationRequest.grammar); the API refuses a request that needs more
    features: frozenset[str] = frozenset({"penalties", "logprobs"})
    #: "module:function" of a pure `refusal(request)` for engines with one: an API process
    #: that runs the engine in another process asks it there (engines/core/core_process.py)
    refusal_function: str | None = None

    @abc.abstractmethod
    def load(self) -> None:
        """Load weights (and start any worker processes); called on the scheduler thread."""

    def refusal(self, request: GenerationRequest) -> str | None:
        """Why this engine would refuse `request` on its own (a limit of its wire, say), or
        None. The API asks before queueing, so such a request is a 400, not a failed insert;
        it must be cheap and safe to call from any thread."""
        return None

    @abc.abstractmethod
    def insert(self, uid: int, request: GenerationRequest) -> int:
        """Add a sequence to the batch; its prefill runs during the next steps.

        Returns how many prompt tokens come from the prefix cache (0 on a miss, or for an
        engine without one): only the rest is prefilled.
        """

    @abc.abstractmethod
    def remove(self, uids: Sequence[int]) -> None:
        """Drop sequences from the batch; their KV caches go to the prefix cache, if any."""

    @abc.abstractmethod
    def step(self) -> list[StepOutput]:
        """Advance every active sequence by one step (decode, or a prefill chunk)."""

    @abc.abstractmethod
    def info(self) -> EngineInfo:
        """Describe the engine for /v1/cluster."""

    def healthy(self) -> bool:
        """False once a rank or stage is lost; /health then reports degraded."""
        return True

    def evict_prefix_cache(self, keep_fraction: float) -> int:
        """Scheduler thread only: drop least-recently-used prefix-cache entries on every node
        until at most keep_fraction of the current cached bytes remain; returns bytes freed.
        Engines without a prefix cache free nothing."""
        return 0

    def memory_held(self) -> dict[str, int]:
        """Bytes this engine holds in this process, by kind ("weights", "prefix_cache"), for
        the memory accounting (observability/process_memory.py); {} where it holds none."""
        return {}

    def step_times(self, uid: int) -> dict[str, float]:
        """Scheduler thread: seconds of the engine's own step segments
        (observability/step_timing.py) spent on steps that carried `uid`, for its request log
        line; engines that measure none return {}."""
        return {}

    def abort(self, reason: str) -> None:  # noqa: B027 (optional: single has nothing remote)
        """From any thread: make a blocked step() raise EngineError at once."""

    def close(self) -> None:  # noqa: B027 (optional hook: engines without resources skip it)
        """Release weights, worker processes and sockets. Idempotent."""

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)
