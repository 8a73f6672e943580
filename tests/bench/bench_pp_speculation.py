"""Speculation over a pipeline: one request's decode tok/s on pp=2 with prompt lookup, beside
pp=2 without it and a single engine without it, on the real SmolLM2-135M-Instruct.

Run from the project root: `python -m tests.bench.bench_pp_speculation` (about ten minutes).
The two stages run over loopback on this machine, each stage with one BLAS thread of its two
cores (the lab's one core per machine, without its links); every contender is loaded once
behind an EngineRunner and the rounds interleave them. It writes docs/benchmarks.md's
"## Speculation over a pipeline" section.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from pathlib import Path

from engines.model.gguf.cache import ensure_imported
from engines.model.smollm2 import serves_float_weights
from tests.bench.bench_speculation import COPY_PROMPTS, FREE_PROMPTS, Run, one, start
from tests.bench.common import markdown_table, write_section
from tests.bench.pipeline_cluster import open_pipeline_runner
from tests.helpers.real_models import smollm2_gguf

HEADING = "## Speculation over a pipeline"
COMMAND = "python -m tests.bench.bench_pp_speculation"
DRAFTED = 8
ROUNDS = 5
PROMPTS = {
    **{f"{name} (copy)": text for name, text in COPY_PROMPTS.items() if name != "document code"},
    "a story (free)": FREE_PROMPTS["a story"],
}
SINGLE, PP, PP_SPEC = "single", "pp=2", f"pp=2, --num-draft-tokens {DRAFTED}"


def main() -> None:
    model = ensure_imported(
        smollm2_gguf(), Path.home() / ".cache" / "tandem", dequantize=serves_float_weights()
    )
    rows = []
    with contextlib.ExitStack() as stack:
        single = start(model, 0)
        stack.callback(single.close)
        contenders = {
            SINGLE: single,
            PP: stack.enter_context(open_pipeline_runner(model, 2)),
            PP_SPEC: stack.enter_context(open_pipeline_runner(model, 2, most_drafted=DRAFTED)),
        }
        for name, text in PROMPTS.items():
            runs: dict[str, list[Run]] = {label: [] for label in contenders}
            for round_ in range(ROUNDS + 1):  # the first is a warm-up
                order = list(contenders)[round_ % 3 :] + list(contenders)[: round_ % 3]
                for label in order:
                    run = one(contenders[label], text)
                    if round_:
                        runs[label].append(run)
            rates = {label: [r.decode_tokens_per_s for r in found] for label, found in runs.items()}
            medians = {label: statistics.median(values) for label, values in rates.items()}
            same = runs[PP_SPEC][0].tokens == runs[PP][0].tokens == runs[SINGLE][0].tokens
            rows.append([
                name, str(len(runs[PP][0].tokens)),
                *(f"{medians[label]:.1f}" for label in contenders),
                f"**{medians[PP_SPEC] / medians[SINGLE]:.2f}x**",
                f"{medians[PP_SPEC] / medians[PP]:.2f}x", "yes" if same else "**no**",
            ])  # fmt: skip
            print(rows[-1], flush=True)
    header = [
        "prompt", "tokens", *(f"{label} tok/s" for label in (SINGLE, PP, PP_SPEC)),
        "pp=2 speculating / single", "/ pp=2", "same greedy tokens",
    ]  # fmt: skip
    body = (
        f"`{COMMAND}`: SmolLM2-135M-Instruct (float32 import), one request at a time, greedy, "
        f"up to 96 tokens; medians of {ROUNDS} interleaved rounds after a warm-up. The pipeline's "
        "two stages run over loopback on this 2-core machine (a BLAS thread each), not on the "
        "lab's separate machines.\n\n" + markdown_table(header, rows)
    )
    print(body)
    if "--no-write" not in sys.argv:
        write_section(HEADING, body)


if __name__ == "__main__":
    main()
