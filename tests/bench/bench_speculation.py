"""Speculative decoding by prompt lookup (--num-draft-tokens) on the real SmolLM2-135M-Instruct:
decode tok/s of one request with and without it, side by side, on copy-heavy prompts (repeat
a text, rename a variable in code, continue a list) and on free-form ones (nothing to copy),
and the aggregate of 8 and 16 concurrent requests (where it stands aside).

Run from the project root: `python -m tests.bench.bench_speculation` (about ten minutes). Each
contender is a SingleEngine behind an EngineRunner (the scheduler the API uses), loaded once;
the rounds alternate which goes first. A request's decode rate counts the tokens after its
first over the time after its first; greedy answers are checked equal token for token. It
prints markdown tables and writes them to docs/benchmarks.md under "## Speculative decoding".
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engines.core.engine_options import EngineOptions
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.model.gguf.cache import ensure_imported
from engines.model.smollm2 import serves_float_weights
from engines.single.engine import SingleEngine
from tests.bench.common import markdown_table, write_section
from tests.helpers.real_models import smollm2_gguf

HEADING = "## Speculative decoding"
COMMAND = "python -m tests.bench.bench_speculation"
DRAFTED = 8  # --num-draft-tokens
ROUNDS = 5
MAX_TOKENS = 96
CODE = (
    "def total_price(items):\n    result = 0\n    for item in items:\n"
    "        result += item.price * item.count\n    return result\n"
)
COPY_PROMPTS = {
    "repeat a text": "Copy this text: Alice was beginning to get very tired of sitting by her "
    "sister on the bank, and of having nothing to do.",
    "rename in code": f"Rewrite this Python code, renaming `result` to `subtotal`:\n\n"
    f"```python\n{CODE}```",
    "document code": f"Here is some code:\n\n```python\n{CODE}```\n\nAdd a docstring to this "
    "function and show the whole function.",
    "continue a list": "Continue this list: Monday, Tuesday, Wednesday, Thursday,",
}
FREE_PROMPTS = {
    "a story": "Write a short story about a lighthouse keeper.",
    "an explanation": "Explain why the sky is blue.",
}
STREAMS = (8, 16)


@dataclass(frozen=True, slots=True)
class Run:
    tokens: tuple[int, ...]
    decode_tokens_per_s: float


def chat(runner: EngineRunner, text: str, uid: str) -> GenerationRequest:
    ids = runner.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    return GenerationRequest(uid, tuple(ids), MAX_TOKENS)


async def timed(runner: EngineRunner, request: GenerationRequest) -> tuple[list[int], list[float]]:
    submission = runner.submit(request)
    tokens, stamps = [], []
    async for event in submission.events():
        if event.token is not None:
            tokens.append(event.token)
            stamps.append(time.perf_counter())
        if event.finish_reason is not None:
            return tokens, stamps
    raise RuntimeError("the stream ended without a final event")


def one(runner: EngineRunner, text: str) -> Run:
    tokens, stamps = asyncio.run(timed(runner, chat(runner, text, "one")))
    return Run(tuple(tokens), (len(tokens) - 1) / (stamps[-1] - stamps[0]))


def many(runner: EngineRunner, texts: list[str]) -> float:
    """Aggregate decode tok/s of requests sent together: tokens after each one's first, over
    the time from the first first token to the last token."""

    async def gather() -> list[tuple[list[int], list[float]]]:
        requests = [chat(runner, text, f"m{i}") for i, text in enumerate(texts)]
        return await asyncio.gather(*(timed(runner, request) for request in requests))

    results = asyncio.run(gather())
    tokens = sum(len(found) - 1 for found, _ in results)
    start = min(stamps[0] for _, stamps in results)
    end = max(stamps[-1] for _, stamps in results)
    return tokens / (end - start)


def start(model_dir: Path, drafted: int) -> EngineRunner:
    runner = EngineRunner(
        SingleEngine(model_dir, EngineOptions(most_drafted=drafted)), queue_size=32, max_batch=16
    )
    runner.start(load_timeout_s=300)
    return runner


def main() -> None:
    model_dir = ensure_imported(
        smollm2_gguf(), Path.home() / ".cache" / "tandem", dequantize=serves_float_weights()
    )
    plain, speculating = start(model_dir, 0), start(model_dir, DRAFTED)
    contenders = {"without": plain, "with": speculating}
    rows = []
    try:
        for kind, prompts in (("copy", COPY_PROMPTS), ("free", FREE_PROMPTS)):
            for name, text in prompts.items():
                runs: dict[str, list[Run]] = {"without": [], "with": []}
                for round_ in range(ROUNDS + 1):  # the first is a warm-up
                    order = ["without", "with"] if round_ % 2 == 0 else ["with", "without"]
                    for label in order:
                        run = one(contenders[label], text)
                        if round_:
                            runs[label].append(run)
                equal = runs["with"][0].tokens == runs["without"][0].tokens
                before = dict(speculating.engine.info().detail["speculation"])
                one(speculating, text)
                after = speculating.engine.info().detail["speculation"]
                drafted = after["drafted"] - before["drafted"]
                accepted = after["accepted"] - before["accepted"]
                rates = {
                    label: [run.decode_tokens_per_s for run in found]
                    for label, found in runs.items()
                }
                medians = {label: statistics.median(values) for label, values in rates.items()}
                ratios = sorted(w / o for w, o in zip(rates["with"], rates["without"], strict=True))
                rows.append([
                    f"{name} ({kind})", str(len(runs["with"][0].tokens)),
                    f"{medians['without']:.1f}", f"{medians['with']:.1f}",
                    f"**{medians['with'] / medians['without']:.2f}x**",
                    f"{ratios[0]:.2f}-{ratios[-1]:.2f}",
                    f"{accepted}/{drafted}", "yes" if equal else "**no**",
                ])  # fmt: skip
                print(rows[-1], flush=True)
        texts = [*COPY_PROMPTS.values(), *FREE_PROMPTS.values()]
        for streams in STREAMS:
            batch = [texts[i % len(texts)] for i in range(streams)]
            found: dict[str, list[float]] = {"without": [], "with": []}
            for round_ in range(ROUNDS + 1):
                order = ["without", "with"] if round_ % 2 == 0 else ["with", "without"]
                for label in order:
                    rate = many(contenders[label], batch)
                    if round_:
                        found[label].append(rate)
            medians = {label: statistics.median(values) for label, values in found.items()}
            ratios = sorted(w / o for w, o in zip(found["with"], found["without"], strict=True))
            rows.append([
                f"{streams} streams, mixed (aggregate)", "-",
                f"{medians['without']:.1f}", f"{medians['with']:.1f}",
                f"**{medians['with'] / medians['without']:.2f}x**",
                f"{ratios[0]:.2f}-{ratios[-1]:.2f}", "-", "-",
            ])  # fmt: skip
            print(rows[-1], flush=True)
    finally:
        plain.close()
        speculating.close()
    header = [
        "prompt", "tokens", "without tok/s", f"with (--num-draft-tokens {DRAFTED}) tok/s",
        "ratio (median)", "ratio spread", "accepted / drafted", "same greedy tokens",
    ]  # fmt: skip
    body = (
        f"`{COMMAND}`: SmolLM2-135M-Instruct (the real model, float32 import), one SingleEngine "
        f"behind an EngineRunner each, greedy, up to {MAX_TOKENS} tokens, medians of {ROUNDS} "
        "interleaved rounds after a warm-up (the spread is the lowest and highest per-round "
        "ratio). Decode tok/s counts the tokens after a request's first over the time after it; "
        "streams: aggregate. Prompt lookup drafts only for a request decoding alone.\n\n"
        + markdown_table(header, rows)
    )
    print(body)
    if "--no-write" not in sys.argv:
        write_section(HEADING, body)


if __name__ == "__main__":
    main()
