"""Where one batched decode step of the single engine spends its time, at 1, 8 and 16 streams.

Run from the project root: `python -m tests.bench.bench_decode_step` (about a minute). The
SingleEngine and the EngineRunner the API uses run in this process on the batching
benchmark's model; each step is split into mlx-lm's `BatchGenerator.next()` (the forward
pass, sampling and waiting for the tokens), the rest of `SingleEngine.step` (turning responses
into outputs), the runner's own work after the step (stop strings, detokenizing, handing events
to the event loop) and the gap between steps (admission, the scheduler's lock). Beside it: the
same batch through a bare `BatchGenerator.next()` loop, and what one SSE chunk costs the event
loop. Writes "## Decode step profile" in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from engines.api.openai.completion_replies import CompletionChunks
from engines.api.streaming import OPENAI_SSE
from engines.core.engine_options import EngineOptions
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.model.demo import ensure_demo_model
from engines.model.gguf.cache import ensure_imported, is_gguf_file
from engines.single.engine import SingleEngine
from tests.bench.bench_batching import MODEL_CACHE, prompts_for
from tests.bench.bench_single import MODEL
from tests.bench.common import markdown_table, write_section

STREAMS = (1, 8, 16)
MAX_TOKENS = 96
TEMPERATURE = 0.8
ROUNDS = 3
HEADING = "## Decode step profile"


class TimedEngine(SingleEngine):
    """SingleEngine whose step times mlx-lm's part and its own."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.next_s = self.step_s = 0.0

    def load(self) -> None:
        super().load()
        generator = self._batch.generator
        original = generator.next

        def timed_next():
            started = time.perf_counter()
            try:
                return original()
            finally:
                self.next_s += time.perf_counter() - started

        generator.next = timed_next

    def step(self):
        started = time.perf_counter()
        try:
            return super().step()
        finally:
            self.step_s += time.perf_counter() - started


class TimedRunner(EngineRunner):
    """EngineRunner that times each whole step (engine step + handling its outputs)."""

    runner_s = 0.0

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            super()._step()
        finally:
            self.runner_s += time.perf_counter() - started


def burst(runner: TimedRunner, count: int, loop: asyncio.AbstractEventLoop) -> dict[str, float]:
    """Per-step means in ms of one burst of `count` streams (decode steps only)."""
    tokenizer = runner.engine.tokenizer
    engine: TimedEngine = runner.engine  # type: ignore[assignment]

    async def one(index: int, prompt: str) -> None:
        request = GenerationRequest(
            f"p{index}", tuple(tokenizer.encode(prompt)), MAX_TOKENS, temperature=TEMPERATURE
        )
        async for _ in runner.submit(request).events():
            pass

    async def run() -> None:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts_for(count))))

    before = (runner.steps, engine.next_s, engine.step_s, runner.runner_s, runner.generated_tokens)
    started = time.perf_counter()
    loop.run_until_complete(run())
    wall = time.perf_counter() - started
    steps = runner.steps - before[0]
    return {
        "steps": steps,
        "tok/s": (runner.generated_tokens - before[4]) / wall,
        "step": 1000 * wall / steps,
        "next": 1000 * (engine.next_s - before[1]) / steps,
        "engine": 1000 * (engine.step_s - before[2] - (engine.next_s - before[1])) / steps,
        "runner": 1000 * (runner.runner_s - before[3] - (engine.step_s - before[2])) / steps,
    }


def bare(engine: SingleEngine, count: int) -> float:
    """ms per step of mlx-lm's BatchGenerator alone over the same model and batch."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    generator = BatchGenerator(
        engine.model, completion_batch_size=count, prefill_batch_size=count,
        sampler=make_sampler(temp=TEMPERATURE),
    )
    tokenizer = engine.tokenizer
    prompts = [tokenizer.encode(p) for p in prompts_for(count)]
    generator.insert(prompts, max_tokens=[MAX_TOKENS] * count)
    stamps = []
    while True:
        _, responses = generator.next()
        if responses:
            stamps.append(time.perf_counter())
        if any(response.finish_reason for response in responses) or len(stamps) > MAX_TOKENS:
            break
    gaps = [later - earlier for earlier, later in zip(stamps[8:], stamps[9:], strict=False)]
    generator.close()
    return 1000 * statistics.median(gaps)


def chunk_cost_us() -> float:
    writer = CompletionChunks("cmpl-profile", 1, "demo", None)
    started = time.perf_counter()
    for _ in range(20000):
        for frame in writer.content("token", []):
            OPENAI_SSE.encode(frame)
    return 1e6 * (time.perf_counter() - started) / 20000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--model", type=Path, help="a model directory or GGUF file instead of "
                        "the batching benchmark's model (implies --no-write)")
    parser.add_argument("--streams", type=int, nargs="+", default=list(STREAMS))
    arguments = parser.parse_args()
    if arguments.model is None:
        model = ensure_demo_model(MODEL_CACHE, MODEL)
    else:
        arguments.no_write = True
        model = arguments.model
        if is_gguf_file(model):
            model = ensure_imported(model, Path.home() / ".cache" / "tandem")
    options = EngineOptions(max_batch=max(arguments.streams))
    runner = TimedRunner(TimedEngine(model, options), queue_size=32, max_batch=options.max_batch)
    runner.start(300)
    loop = asyncio.new_event_loop()
    rows = []
    try:
        burst(runner, 2, loop)  # warm-up
        for count in arguments.streams:
            samples = [burst(runner, count, loop) for _ in range(ROUNDS)]
            bare_ms = statistics.median(bare(runner.engine, count) for _ in range(ROUNDS))
            median = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
            rows.append([
                str(count), f"{median['tok/s']:.0f}", f"{median['step']:.2f}",
                f"{median['next']:.2f}", f"{median['engine']:.3f}", f"{median['runner']:.3f}",
                f"{median['step'] - median['next'] - median['engine'] - median['runner']:.3f}",
                f"{bare_ms:.2f}",
            ])
    finally:
        runner.close()
        loop.close()
    table = markdown_table(
        ["streams", "tok/s", "ms per step", "BatchGenerator.next", "rest of engine.step",
         "runner after the step", "between steps", "bare BatchGenerator, ms per step"],
        rows,
    )
    body = (
        f"`python -m tests.bench.bench_decode_step`: the batching benchmark's model, {MAX_TOKENS} "
        f"tokens per stream at temperature {TEMPERATURE} without a seed, in-process (no HTTP); "
        f"means per decode step in ms, medians of {ROUNDS} bursts. Prefill steps are included "
        "in the step count, so the first columns are a little below a pure decode step.\n\n"
        + table
        + f"\n\nOne SSE chunk (build the completion chunk, encode it): {chunk_cost_us():.1f} us "
        "on the event loop."
    )
    print(body)
    if not arguments.no_write:
        write_section(HEADING, body)


if __name__ == "__main__":
    main()
