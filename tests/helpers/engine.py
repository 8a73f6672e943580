"""Drive real engines the way the API does: through an EngineRunner, or step by step."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from engines.core.engine import Engine
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from errors import EngineError


@dataclass
class Outcome:
    tokens: list[int]
    text: str
    finish: str | None
    error: str | None
    events: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float | None] = field(default_factory=list)  # per token, when asked
    drafted_tokens: int = 0  # speculative decoding's drafts, and those accepted
    accepted_tokens: int = 0


async def collect(
    runner: EngineRunner, request: GenerationRequest, cancel_after: int = 0
) -> Outcome:
    """Submit `request` and read its events to the end (cancelling after N tokens if asked)."""
    submission = runner.submit(request)
    tokens: list[int] = []
    logprobs: list[float | None] = []
    text, events = "", 0
    async for event in submission.events():
        events += 1
        if event.token is not None:
            tokens.append(event.token)
            logprobs.append(event.logprob)
            if len(tokens) == cancel_after:
                submission.cancel()
        text += event.text
        if event.finish_reason is not None:
            return Outcome(
                tokens,
                text,
                event.finish_reason,
                event.error,
                events,
                event.prompt_tokens,
                event.completion_tokens,
                event.cached_tokens,
                logprobs,
                event.drafted_tokens,
                event.accepted_tokens,
            )
    raise AssertionError("the event stream ended without a final event")


def run_all(
    runner: EngineRunner,
    requests: list[GenerationRequest],
    cancel_after: dict[int, int] | None = None,
    timeout_s: float = 120,
) -> list[Outcome]:
    """Submit every request at once (one batch) and wait for all of them."""
    cancel_after = cancel_after or {}

    async def gather() -> list[Outcome]:
        calls = (collect(runner, r, cancel_after.get(i, 0)) for i, r in enumerate(requests))
        return list(await asyncio.wait_for(asyncio.gather(*calls), timeout_s))

    return asyncio.run(gather())


def run_one(runner: EngineRunner, request: GenerationRequest, cancel_after: int = 0) -> Outcome:
    return asyncio.run(asyncio.wait_for(collect(runner, request, cancel_after), 120))


def make_request(engine: Engine, prompt: str, max_tokens: int, **options: Any) -> GenerationRequest:
    tokens = tuple(engine.tokenizer.encode(prompt))
    return GenerationRequest(f"r-{prompt[:8]}-{max_tokens}", tokens, max_tokens, **options)


def start_batch(engine: Engine, prompt: tuple[int, ...], size: int, steps: int) -> None:
    """Insert `size` long sequences and step until every one has produced `steps` tokens."""
    for uid in range(size):
        engine.insert(uid, GenerationRequest(f"b{uid}", prompt, 100_000))
    produced = dict.fromkeys(range(size), 0)
    deadline = time.monotonic() + 120
    while min(produced.values()) < steps:
        assert time.monotonic() < deadline, "the batch never got going"
        for output in engine.step():
            assert output.error is None, output.error
            produced[output.uid] += 1


def step_until_error(engine: Engine, limit_s: float = 60) -> tuple[EngineError, float]:
    """Step the running batch until EngineError; returns it and the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        try:
            engine.step()
        except EngineError as error:
            return error, time.monotonic() - started
    raise AssertionError(f"no EngineError within {limit_s} s")
