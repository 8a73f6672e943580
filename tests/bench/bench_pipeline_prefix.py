"""Pipeline prefix cache: time to first token of a follow-up turn vs the first turn, pp=2.

Run from the project root: `python -m tests.bench.bench_pipeline_prefix` (about a minute).
Each round is a new two-turn conversation on a ~1,000-token shared prefix, through an
in-process EngineRunner (no HTTP) over a real 2-stage pipeline on 127.0.0.1. Prints a table;
docs/benchmarks.md is left to the combined prefix-cache benchmark.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engines.base import GenerationRequest
from engines.demo_model import DemoSpec, write_demo_model
from engines.runner import EngineRunner
from tests.bench.common import markdown_table
from tests.bench.pipeline_cluster import open_pipeline_runner

MODEL = DemoSpec(layers=8, hidden=512, heads=8, kv_heads=4, vocab=1024)  # as in issue 9
PREFIX_TOKENS = 1000
ANSWER_TOKENS = 16
ROUNDS = 3
CACHE_BYTES = 1 << 30
COMMAND = "python -m tests.bench.bench_pipeline_prefix"


@dataclass(frozen=True, slots=True)
class Turn:
    first_token_s: float
    tokens: tuple[int, ...]
    cached: int


async def _turn(runner: EngineRunner, prompt: tuple[int, ...]) -> Turn:
    request = GenerationRequest(f"bench-{len(prompt)}", prompt, ANSWER_TOKENS)
    started = time.monotonic()
    first_token_s = None
    tokens = []
    async for event in runner.submit(request).events():
        if event.token is not None:
            if first_token_s is None:
                first_token_s = time.monotonic() - started
            tokens.append(event.token)
        if event.finish_reason is not None:
            if event.error is not None or first_token_s is None:
                raise RuntimeError(f"the turn failed: {event.error or 'no token'}")
            return Turn(first_token_s, tuple(tokens), event.cached_tokens)
    raise RuntimeError("the stream ended without a final event")


def turn(runner: EngineRunner, prompt: tuple[int, ...]) -> Turn:
    return asyncio.run(asyncio.wait_for(_turn(runner, prompt), timeout=300))


def shared_prefix(runner: EngineRunner, conversation: int) -> tuple[int, ...]:
    """About PREFIX_TOKENS tokens of system prompt, different for every conversation."""
    encode = runner.engine.tokenizer.encode
    text = f"Conversation {conversation}. "
    rule = 0
    while len(encode(text)) < PREFIX_TOKENS:
        rule += 1
        text += f"Rule {rule}: the stages pass sealed activations down the chain in order. "
    return tuple(encode(text))[:PREFIX_TOKENS]


def main() -> None:
    load_start = os.getloadavg()[0]
    rows, ratios = [], []
    with tempfile.TemporaryDirectory() as directory:
        model = write_demo_model(Path(directory) / "bench-model", MODEL)
        with open_pipeline_runner(model, 2, prefix_cache_bytes=CACHE_BYTES) as runner:
            encode = runner.engine.tokenizer.encode
            turn(runner, tuple(encode("Warm up the pipeline.")))
            for conversation in range(ROUNDS):
                first_prompt = shared_prefix(runner, conversation) + tuple(encode(" First?"))
                first = turn(runner, first_prompt)
                follow_prompt = first_prompt + first.tokens + tuple(encode(" And then?"))
                follow = turn(runner, follow_prompt)
                ratio = follow.first_token_s / first.first_token_s
                ratios.append(ratio)
                rows.append(
                    [
                        str(conversation),
                        f"{len(first_prompt)} / {first.cached}",
                        f"{first.first_token_s * 1e3:.0f}",
                        f"{len(follow_prompt)} / {follow.cached}",
                        f"{follow.first_token_s * 1e3:.0f}",
                        f"{ratio:.3f}x",
                    ]
                )
    header = [
        "conversation",
        "first: prompt / cached tokens",
        "first TTFT (ms)",
        "follow-up: prompt / cached tokens",
        "follow-up TTFT (ms)",
        "follow-up / first",
    ]
    sys.stdout.write(
        f"Demo model: llama, {MODEL.layers} layers, hidden {MODEL.hidden}, float32; pp=2 "
        f"(4 + 4 layers), default 256-token prefill chunks, {ANSWER_TOKENS}-token answers.\n\n"
        + markdown_table(header, rows)
        + f"\nmedian follow-up / first: {statistics.median(ratios):.3f}x; load average "
        f"{load_start:.1f} / {os.getloadavg()[0]:.1f}\n\nCommand: `{COMMAND}`\n"
    )


if __name__ == "__main__":
    main()
