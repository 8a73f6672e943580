"""Where speculation stops paying as the batch grows (issue 41), measured on the real model.

A verifying pass feeds each of B rows its next token and k drafted ones: B x (k+1) positions
where a plain step feeds B. It pays only if a row's accepted tokens per pass (plus the model's
own one) exceed the pass's cost over a plain step's. This times both on SmolLM2-135M-Instruct
(float32 import, the engine's BLAS threads) at B = 1 to 16 rows and k = 1 to 8, each row
attending over a 256-token context, and sets the cost beside the tokens per pass that prompt
lookup reaches on bench_speculation's prompts: replayed over the model's greedy answer to each,
drafting as served (the length adapting to acceptance, at most 8) and always the most allowed.

Run from the project root: `python -m tests.bench.bench_speculation_crossover` (about five
minutes; `--no-write`). Writes "## Speculation: the batch crossover" in docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import engines  # noqa: F401  (MKL under mlx: imported before mlx)
from engines.model.gguf.cache import ensure_imported
from engines.model.smollm2 import serves_float_weights
from engines.speculation.draft_length import DraftLength
from engines.speculation.lane import accepted_prefix
from engines.speculation.prompt_lookup import PromptLookup
from tests.bench.bench_speculation import COPY_PROMPTS, FREE_PROMPTS, MAX_TOKENS
from tests.bench.common import markdown_table, write_section
from tests.helpers.real_models import smollm2_gguf

HEADING = "## Speculation: the batch crossover"
COMMAND = "python -m tests.bench.bench_speculation_crossover"
ROWS = (1, 2, 4, 8, 16)
DRAFTED = (1, 2, 4, 8)
CONTEXT = 256
REPEATS = 15
ROUNDS = 3


def pass_ms(model, cache: list, rows: int, positions: int) -> float:
    """Median ms of one forward pass of `rows` x `positions` new tokens over the cached
    context, the new positions trimmed off again after each pass (as a rejected draft is)."""
    import mlx.core as mx
    from mlx_lm.models.cache import trim_prompt_cache

    feed = mx.array([[13] * positions] * rows)
    times = []
    for _ in range(REPEATS + 2):
        started = time.perf_counter()
        mx.eval(model(feed, cache=cache))
        times.append(time.perf_counter() - started)
        trim_prompt_cache(cache, positions)
    return 1000 * statistics.median(times[2:])


def measure(model) -> dict[tuple[int, int], float]:
    """Per (rows, positions): the median over ROUNDS rounds of each pass's median; within a
    round each batch reads its context once, then every length in turn (reversed every other
    round)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    lengths = [1 + k for k in (0, *DRAFTED)]
    found: dict[tuple[int, int], list[float]] = {
        (rows, positions): [] for rows in ROWS for positions in lengths
    }
    for round_ in range(ROUNDS):
        for rows in ROWS:
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array([[11] * CONTEXT] * rows), cache=cache))
            for positions in lengths if round_ % 2 == 0 else reversed(lengths):
                found[(rows, positions)].append(pass_ms(model, cache, rows, positions))
        print(f"round {round_ + 1} done", flush=True)
    return {shape: statistics.median(times) for shape, times in found.items()}


def tokens_per_pass(prompt: list[int], answer: list[int], most: int, adapt: bool) -> float:
    """Replay prompt lookup over a known answer: the tokens after the first (which prefill
    gives) over the verifying passes that would have produced them."""
    lookup, length = PromptLookup([*prompt, answer[0]]), DraftLength(most)
    done, passes = 1, 0
    while done < len(answer):
        draft = lookup.draft(length.next() if adapt else most)
        kept = accepted_prefix(answer[done : done + len(draft) + 1], draft)
        length.record(len(draft), len(kept) - 1)
        lookup.extend(kept)
        done, passes = done + len(kept), passes + 1
    return (len(answer) - 1) / passes


def lookup_rows(model, tokenizer) -> list[list[str]]:
    """Per prompt: the greedy answer's length and the tokens per pass prompt lookup reaches."""
    from mlx_lm import stream_generate

    rows = []
    for kind, prompts in (("copy", COPY_PROMPTS), ("free", FREE_PROMPTS)):
        for name, text in prompts.items():
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True
            )
            answer = [
                response.token
                for response in stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)
            ]
            rows.append([
                f"{name} ({kind})", str(len(answer)),
                *(f"{tokens_per_pass(prompt, answer, most, adapt):.2f}"
                  for most, adapt in ((8, True), (8, False), (16, False))),
            ])  # fmt: skip
    return rows


def main() -> None:
    from mlx_lm import load

    model_dir = ensure_imported(
        smollm2_gguf(), Path.home() / ".cache" / "tandem", dequantize=serves_float_weights()
    )
    model, tokenizer = load(str(model_dir))
    began = time.monotonic()
    replayed = lookup_rows(model, tokenizer)
    times = measure(model)
    rows = []
    for count in ROWS:
        plain = times[(count, 1)]
        rows.append([
            str(count), f"{plain:.1f}",
            *(f"{times[(count, 1 + k)] / plain:.2f}" for k in DRAFTED),
        ])  # fmt: skip
    header = ["rows", "plain step ms", *(f"k={k}: pass / plain" for k in DRAFTED)]
    minutes = (time.monotonic() - began) / 60
    text = "\n\n".join([
        f"`{COMMAND}` ({minutes:.0f} minutes): SmolLM2-135M-Instruct (float32 import) in "
        f"process, each row over a {CONTEXT}-token context; a verifying pass of k drafted "
        "tokens per row against a plain step of the same rows (medians of "
        f"{REPEATS} passes, then of {ROUNDS} interleaved rounds). Speculation pays where a "
        "row's tokens per pass (accepted + 1) exceed the pass / plain ratio.",
        markdown_table(header, rows),
        "What a row gets per pass: prompt lookup replayed over the model's greedy answer to "
        "bench_speculation's prompts (its first token comes from the prefill).",
        markdown_table(
            ["prompt", "answer tokens", "as served (adapting, <= 8)", "always 8", "always 16"],
            replayed,
        ),
    ])  # fmt: skip
    print(text)
    if "--no-write" not in sys.argv:
        write_section(HEADING, text)


if __name__ == "__main__":
    main()
