"""Turns against a runner with a prefix cache: a prompt's tokens, how it finished and how
many of its tokens came from the cache (tests/pipeline's prefix cache and disk tier)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner

SYSTEM = "You are a careful assistant. Answer in one short paragraph and cite the rules. " * 3
MAX_TOKENS = 12


@dataclass(frozen=True)
class Turn:
    tokens: list[int]
    finish: str | None
    cached: int


async def _collect(runner: EngineRunner, prompt: tuple[int, ...]) -> Turn:
    request = GenerationRequest(f"turn-{len(prompt)}", prompt, MAX_TOKENS)
    tokens: list[int] = []
    async for event in runner.submit(request).events():
        if event.token is not None:
            tokens.append(event.token)
        if event.finish_reason is not None:
            assert event.error is None, event.error
            return Turn(tokens, event.finish_reason, event.cached_tokens)
    raise AssertionError("the event stream ended without a final event")


def ask(runner: EngineRunner, prompt: tuple[int, ...]) -> Turn:
    return asyncio.run(asyncio.wait_for(_collect(runner, prompt), timeout=60))


def ask_all(runner: EngineRunner, prompts: list[tuple[int, ...]]) -> list[Turn]:
    async def burst() -> list[Turn]:
        return list(await asyncio.gather(*(_collect(runner, prompt) for prompt in prompts)))

    return asyncio.run(asyncio.wait_for(burst(), timeout=90))
