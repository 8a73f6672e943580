"""pp=2 prefix reuse: shared prefill's prefilled tokens, and a disk hit after a restart.

Run from the project root: `python -m tests.bench.bench_pp_prefix_reuse` (a few minutes; the
bench demo model, 8 layers x hidden 512, on a loopback pipeline of 2 stages). Part 1: 8 first
turns sharing the ~1,000-token system prompt of bench_prefix_cache, sent together, with the
prefix cache (and so shared prefill) on and off; reported: the prompt tokens the stages ran in
prefill chunks (`engine.info().detail["prefilled_tokens"]`, counted where they are computed) in
prompts' worth, and whether the greedy answers are equal. Part 2: a conversation's first turn
on a chain whose entries all go to disk, the chain stopped and started again on the same
directories, then the follow-up turn (the whole history and a new question), against the
same follow-up on a fresh chain with an empty cache; each after a warm-up request of its own.
Reported: median time to first token of each and their ratio. Prints only.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.model.demo import ensure_demo_model
from tests.bench.bench_prefix_cache import QUESTIONS, SYSTEM, runner_asker
from tests.bench.bench_single import MODEL, MODEL_CACHE
from tests.bench.pipeline_cluster import open_pipeline_runner

USERS = 8
ROUNDS = 3
TOKENS = 8
WRITE_PAUSE_S = 1.0  # after the first turn: its entry's files are written by then


def first_turns(runner: EngineRunner, tag: str) -> list[GenerationRequest]:
    encode = runner.engine.tokenizer.encode
    return [
        GenerationRequest(f"{tag}-{n}", tuple(encode(f"{SYSTEM}\nUser {n}: hi?\nAssistant:")), 16)
        for n in range(USERS)
    ]


async def answers(runner: EngineRunner, requests: list[GenerationRequest]) -> list[list[int]]:
    async def one(request: GenerationRequest) -> list[int]:
        tokens = []
        async for event in runner.submit(request).events():
            if event.error:
                raise RuntimeError(event.error)
            if event.token is not None:
                tokens.append(event.token)
        return tokens

    return list(await asyncio.gather(*(one(request) for request in requests)))


def shared_first_turns(model: Path, cache_bytes: int) -> tuple[float, list[list[int]]]:
    """Prompts' worth of prefill for 8 first turns sent together, and their answers."""
    with open_pipeline_runner(model, 2, prefix_cache_bytes=cache_bytes) as runner:
        requests = first_turns(runner, "shared")
        before = runner.engine.info().detail["prefilled_tokens"]
        tokens = asyncio.run(answers(runner, requests))
        prefilled = runner.engine.info().detail["prefilled_tokens"] - before
    return prefilled / statistics.mean(len(r.prompt_tokens) for r in requests), tokens


def follow_up_ttft(model: Path, directory: Path, system: str, restart: bool) -> tuple[float, int]:
    """The follow-up's TTFT and cached tokens: after a restart that finds the first turn on
    disk (`restart`), or on a fresh chain with an empty cache."""
    disk = {"prefix_cache_bytes": 1 << 20, "prefix_cache_disk_bytes": 4 << 30}
    first_prompt = f"{system}\nUser: {QUESTIONS[0]}\nAssistant:"
    first_text = ""
    if restart:
        with open_pipeline_runner(model, 2, prefix_cache_dir=directory, **disk) as runner:
            first_text = asyncio.run(runner_asker(runner)(first_prompt, TOKENS)).text
            time.sleep(WRITE_PAUSE_S)
    else:  # the same first answer, computed on a chain that keeps nothing of it
        with open_pipeline_runner(model, 2) as runner:
            first_text = asyncio.run(runner_asker(runner)(first_prompt, TOKENS)).text
    follow_prompt = f"{first_prompt}{first_text}\nUser: {QUESTIONS[1]}\nAssistant:"
    with open_pipeline_runner(model, 2, prefix_cache_dir=directory, **disk) as runner:
        ask = runner_asker(runner)
        asyncio.run(ask(f"Warm-up {time.time()}: count to ten.", TOKENS))
        turn = asyncio.run(ask(follow_prompt, TOKENS))
    return turn.first_token_s, turn.cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    arguments = parser.parse_args()
    model = ensure_demo_model(MODEL_CACHE, MODEL)
    shared, shared_tokens = shared_first_turns(model, 1 << 30)
    alone, alone_tokens = shared_first_turns(model, 0)
    print(
        f"{USERS} first turns, one system prompt, pp=2: prefilled {shared:.2f} prompts' worth "
        f"with shared prefill, {alone:.2f} with the prefix cache off; "
        f"answers equal: {shared_tokens == alone_tokens}",
        flush=True,
    )
    cold, warm = [], []
    with tempfile.TemporaryDirectory(prefix="tandem-pp-restart-") as scratch:
        for index in range(arguments.rounds):
            system = f"[round {index}] {SYSTEM}"
            ttft, cached = follow_up_ttft(model, Path(scratch) / f"cold-{index}", system, False)
            cold.append(ttft)
            ttft, hit = follow_up_ttft(model, Path(scratch) / f"warm-{index}", system, True)
            warm.append(ttft)
            print(
                f"round {index}: cold {cold[-1]:.3f} s ({cached} cached), after a restart "
                f"{warm[-1]:.3f} s ({hit} cached from disk)",
                flush=True,
            )
    ratio = statistics.median(warm) / statistics.median(cold)
    print(
        f"follow-up TTFT, pp=2, medians of {arguments.rounds}: cold "
        f"{statistics.median(cold):.3f} s, from disk after a restart "
        f"{statistics.median(warm):.3f} s: {ratio:.3f}x"
    )


if __name__ == "__main__":
    main()
