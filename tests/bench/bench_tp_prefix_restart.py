"""tp=2 prefix cache: shared prefill's prefilled tokens, and a disk hit after a restart.

Run from the project root: `python -m tests.bench.bench_tp_prefix_restart` (about two
minutes; prints, writes nothing). The prefix-cache benchmark's model and system prompt
(tests/bench/bench_prefix_cache.py), tp=2 over loopback, both ranks on this machine.

1. Shared prefill: 8 first turns with one ~1,000-token system prompt sent at once, with the
   prefix cache off and on; the prompt tokens the ranks prefilled (the engine's
   `prefilled_tokens`, as rank 0 reports it), in prompts' worth.
2. Restart: a group with a 1 MB memory tier and a disk tier answers `--rounds` first turns
   (each its own system prompt; their entries go to disk), is closed, and a new group with
   the same plan and directory answers each follow-up from disk. Reported: medians of the
   first turns' and the follow-ups' time to first token, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from engines.model.demo import ensure_demo_model
from tests.bench.bench_prefix_cache import (
    CONVERSATIONS,
    FIRST_TOKENS,
    QUESTIONS,
    SYSTEM,
    runner_asker,
)
from tests.bench.bench_single import MODEL, MODEL_CACHE
from tests.bench.tp_cluster import open_tensor_parallel_runner

ROUNDS = 3
# Closing a runner kills rank 0 at once (the scheduler aborts its engine first), so an entry
# still being written is lost: a miss after the restart. Wait as a user reading would.
WRITE_PAUSE_S = 2.0


def shared_prefill(model_path: Path, prefix_cache_bytes: int) -> tuple[float, float]:
    """(prompts' worth the ranks prefilled for 8 first turns sent at once, median TTFT s)."""
    with open_tensor_parallel_runner(
        model_path, 2, prefix_cache_bytes=prefix_cache_bytes
    ) as runner:
        ask = runner_asker(runner)
        asyncio.run(ask(f"[warm-up] {SYSTEM[:200]}", 2))
        before = runner.engine.info().detail["prefilled_tokens"]

        async def first_turns():
            prompts = [f"[shared] {SYSTEM}\nUser: question {n}?\nAssistant:" for n in range(8)]
            return await asyncio.gather(*(ask(prompt, 8) for prompt in prompts))

        turns = asyncio.run(first_turns())
        prefilled = runner.engine.info().detail["prefilled_tokens"] - before
    prompt = statistics.mean(turn.prompt_tokens for turn in turns)
    return prefilled / prompt, statistics.median(turn.first_token_s for turn in turns)


def restart(model_path: Path, rounds: int) -> tuple[float, float, list[int]]:
    """(median first-turn TTFT s, median follow-up TTFT s after a restart, cached tokens)."""
    with tempfile.TemporaryDirectory(prefix="tandem-tp-restart-") as scratch:
        options = {
            "prefix_cache_bytes": 1 << 20, "prefix_cache_disk_bytes": 4 << 30,
            "prefix_cache_dir": scratch,
        }  # fmt: skip
        follow_prompts, first_times = [], []
        with open_tensor_parallel_runner(model_path, 2, **options) as runner:
            ask = runner_asker(runner)
            asyncio.run(ask(f"[warm-up] {SYSTEM}\nUser: hi\nAssistant:", 2))
            for index in range(rounds):
                prompt = f"[round {index}] {SYSTEM}\nUser: {QUESTIONS[0]}\nAssistant:"
                first = asyncio.run(ask(prompt, FIRST_TOKENS))
                first_times.append(first.first_token_s)
                follow_prompts.append(f"{prompt}{first.text}\nUser: {QUESTIONS[1]}\nAssistant:")
            time.sleep(WRITE_PAUSE_S)  # the last answer's entry is kept and written
        # a new group: the same plan and directory
        with open_tensor_parallel_runner(model_path, 2, **options) as runner:
            ask = runner_asker(runner)
            asyncio.run(ask("warm-up", 2))
            follows = [asyncio.run(ask(prompt, FIRST_TOKENS)) for prompt in follow_prompts]
    return (
        statistics.median(first_times),
        statistics.median(turn.first_token_s for turn in follows),
        [turn.cached_tokens for turn in follows],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    arguments = parser.parse_args()
    model_path = ensure_demo_model(MODEL_CACHE, MODEL)
    print(f"tp=2, {CONVERSATIONS} shared-prefix first turns sent at once:")
    for label, budget in (("cache off", 0), ("cache on", 1 << 30)):
        worth, ttft = shared_prefill(model_path, budget)
        print(f"  {label}: {worth:.2f} prompts' worth prefilled, first-turn TTFT p50 {ttft:.2f} s")
    first, follow, cached = restart(model_path, arguments.rounds)
    print(f"tp=2 disk hit after a restart ({arguments.rounds} rounds, medians):")
    print(f"  first turn {first:.3f} s, follow-up after restart {follow:.3f} s, cached {cached}")
    print(f"  follow-up / cold first turn: {follow / first:.3f}x")


if __name__ == "__main__":
    main()
