"""--kv-bits on the real model (SmolLM2-135M-Instruct imported from its GGUF): tandem's greedy
answers against mlx-lm's own with the same KV quantization, and each mode's divergence from full
precision.

Run from the project root: `python -m tests.bench.bench_kv_bits_real` (a few minutes on a CPU).

Equality: 12 short chat prompts, greedy, up to MAX_TOKENS tokens (EOS ends an answer), through
the single engine (each prompt alone, then all 12 in one batch) and through pp=2 (two stages on
127.0.0.1, alone then together), each against mlx-lm's generate_step with the same kv_bits,
kv_group_size=64 and quantized_kv_start. Divergence: for each mode, the same prompts
teacher-forced along full precision's greedy answer (mlx-lm's own caches and
maybe_quantize_kv_cache, so the mode is exactly mlx-lm's), per position: whether the top token
is full precision's, and KL(full || mode) of the next-token distributions. "from the first
token" is the cache quantized before the prompt is read (what tandem did before
--quantized-kv-start). It prints markdown tables and writes them to docs/benchmarks.md under
"## Quantized KV cache on the real model".
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engines.core import blas

blas.activate()  # before mlx loads: the BLAS the engines run on

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generate_step, maybe_quantize_kv_cache  # noqa: E402
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache  # noqa: E402

from discovery.cluster_key import generate_key  # noqa: E402
from engines.core.engine_options import EngineOptions  # noqa: E402
from engines.core.request import GenerationRequest  # noqa: E402
from engines.core.runner import EngineRunner  # noqa: E402
from engines.model.gguf.cache import ensure_imported  # noqa: E402
from engines.single.engine import SingleEngine  # noqa: E402
from planner import allocate_layers  # noqa: E402
from tests.bench.common import markdown_table, write_section  # noqa: E402
from tests.helpers.engine import run_all, run_one  # noqa: E402
from tests.helpers.pipeline import make_engine, start_workers, stop_workers  # noqa: E402
from tests.helpers.real_models import smollm2_gguf  # noqa: E402

CACHE = Path(tempfile.gettempdir()) / "tandem-bench"
SYSTEM = "Answer in a few words."
QUESTIONS = (
    "What is the capital of France?",
    "What is 3+5?",
    "What is the opposite of hot?",
    "What color is the sky on a clear day?",
    "How many legs does a spider have?",
    "What is the largest planet in the solar system?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Name a primary color.",
    "What do bees make?",
    "What is the chemical symbol for gold?",
    "How many days are in a week?",
)
MAX_TOKENS = 24
GROUP_SIZE = 64  # the model's heads are 64 wide
MODES = ((8, 0), (4, 0))  # (kv_bits, quantized_kv_start): the setting
LOAD_TIMEOUT_S = 300
FRAME_TIMEOUT_S = 120.0  # a stage's frame on a CPU shared with other work can take seconds
BATCH_TIMEOUT_S = 1800  # 12 streams of a 30-layer model on a shared CPU: minutes
HEADING = "## Quantized KV cache on the real model"
COMMAND = "python -m tests.bench.bench_kv_bits_real"


def prompts(tokenizer: Any) -> list[list[int]]:
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                add_generation_prompt=True,
            )
        )
        for question in QUESTIONS
    ]


def until_eos(tokens: Sequence[int], eos: set[int]) -> list[int]:
    """An answer's tokens before its EOS, as the engines report them."""
    out = []
    for token in tokens:
        if token in eos:
            break
        out.append(int(token))
    return out


def mlx_lm_answers(model: Any, all_prompts: list[list[int]], bits: int | None, start: int, eos):
    answers = []
    for prompt in all_prompts:
        steps = generate_step(
            mx.array(prompt), model, max_tokens=MAX_TOKENS, kv_bits=bits,
            kv_group_size=GROUP_SIZE, quantized_kv_start=start,
        )  # fmt: skip
        answers.append(until_eos([token for token, _ in steps], eos))
    return answers


def engine_answers(runner: EngineRunner, all_prompts: list[list[int]], eos) -> tuple[list, list]:
    requests = [
        GenerationRequest(f"q{index}", tuple(prompt), MAX_TOKENS)
        for index, prompt in enumerate(all_prompts)
    ]
    alone = [until_eos(run_one(runner, request).tokens, eos) for request in requests]
    batched = run_all(runner, requests, timeout_s=BATCH_TIMEOUT_S)
    together = [until_eos(outcome.tokens, eos) for outcome in batched]
    return alone, together


def single_answers(model_dir: Path, bits: int, start: int, all_prompts, eos):
    engine = SingleEngine(model_dir, EngineOptions(kv_bits=bits, quantized_kv_start=start))
    runner = EngineRunner(engine, queue_size=len(all_prompts), max_batch=len(all_prompts))
    runner.start(LOAD_TIMEOUT_S)
    try:
        return engine_answers(runner, all_prompts, eos)
    finally:
        runner.close()


def pipeline_answers(model_dir: Path, bits: int, start: int, all_prompts, eos, logs: Path):
    key = generate_key()
    ranges = allocate_layers(30, [8, 8])
    options = {"kv_bits": bits, "quantized_kv_start": start}
    listener, workers = start_workers(
        model_dir, ranges, key, logs, read_timeout_s=FRAME_TIMEOUT_S, stage_options=options
    )
    engine = make_engine(
        model_dir, ranges, key, listener, workers, token_timeout_s=FRAME_TIMEOUT_S, **options
    )
    runner = EngineRunner(engine, queue_size=len(all_prompts), max_batch=len(all_prompts))
    try:
        runner.start(LOAD_TIMEOUT_S)
        return engine_answers(runner, all_prompts, eos)
    finally:
        runner.close()
        engine.close()
        stop_workers(workers)


def equal_count(got: list[list[int]], expected: list[list[int]]) -> int:
    return sum(mine == theirs for mine, theirs in zip(got, expected, strict=True))


def forced_logprobs(model: Any, prompt: list[int], answer: list[int], mode: tuple) -> mx.array:
    """Next-token log-probabilities (N, V) at the prompt's last token and each answer token
    but the last, mlx-lm's way: the prompt but its last token in one pass, then one token per
    pass, maybe_quantize_kv_cache after each; `mode` (bits, start) or (bits, "first")."""
    bits, start = mode
    if start == "first":
        cache = [QuantizedKVCache(GROUP_SIZE, bits) for _ in model.layers]
    else:
        cache = make_prompt_cache(model)

    def after_pass() -> None:
        if start != "first":
            maybe_quantize_kv_cache(cache, start, GROUP_SIZE, bits)

    model(mx.array(prompt[:-1])[None], cache=cache)
    after_pass()
    rows = []
    for token in [prompt[-1], *answer[:-1]]:
        logits = model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)
        after_pass()
        rows.append(logits - mx.logsumexp(logits))
    return mx.stack(rows)


def divergence(model: Any, all_prompts, answers, full_logprobs, mode) -> tuple[float, float, int]:
    """Top-1 agreement with full precision and mean KL(full || mode) per token, over every
    position of every answer; and the positions counted."""
    agree, kl, count = 0, 0.0, 0
    for prompt, answer, full in zip(all_prompts, answers, full_logprobs, strict=True):
        if not answer:
            continue
        other = forced_logprobs(model, prompt, answer, mode)
        agree += int(mx.sum(mx.argmax(full, axis=-1) == mx.argmax(other, axis=-1)).item())
        kl += float(mx.sum(mx.exp(full) * (full - other)).item())
        count += len(answer)
    return agree / count, kl / count, count


def main() -> None:
    model_dir = ensure_imported(smollm2_gguf(), CACHE)
    model, tokenizer = load(str(model_dir))
    eos = set(tokenizer.eos_token_ids)
    all_prompts = prompts(tokenizer)
    logs = Path(tempfile.mkdtemp(prefix="kv-bits-real-"))
    equality_rows = []
    for bits, start in MODES:
        expected = mlx_lm_answers(model, all_prompts, bits, start, eos)
        single_alone, single_together = single_answers(model_dir, bits, start, all_prompts, eos)
        pp_alone, pp_together = pipeline_answers(model_dir, bits, start, all_prompts, eos, logs)
        counts = [
            equal_count(answers, expected)
            for answers in (single_alone, single_together, pp_alone, pp_together)
        ]
        equality_rows.append(
            [f"{bits}", f"{start}", *(f"{count}/{len(expected)}" for count in counts)]
        )
        print(equality_rows[-1], flush=True)

    full_answers = mlx_lm_answers(model, all_prompts, None, 0, eos)
    modes = [(8, "first"), (8, 0), (8, 16), (4, "first"), (4, 0), (4, 16), (8, 5000), (4, 5000)]
    full_logprobs = [
        forced_logprobs(model, prompt, answer, (None, 10**9)) if answer else None
        for prompt, answer in zip(all_prompts, full_answers, strict=True)
    ]
    divergence_rows = []
    for mode in modes:
        agree, kl, count = divergence(model, all_prompts, full_answers, full_logprobs, mode)
        start = "from the first token" if mode[1] == "first" else f"quantized_kv_start={mode[1]}"
        divergence_rows.append([f"{mode[0]}", start, f"{agree:.1%}", f"{kl:.5f}", f"{count}"])
        print(divergence_rows[-1], flush=True)

    equality = markdown_table(
        [
            "--kv-bits",
            "--quantized-kv-start",
            "single, alone",
            "single, 12 in a batch",
            "pp=2, alone",
            "pp=2, 12 in flight",
        ],
        equality_rows,
    )
    diverging = markdown_table(
        ["bits", "when quantized", "top-1 agreement", "KL per token (nats)", "positions"],
        divergence_rows,
    )
    print(equality)
    print(diverging)
    prompt_lengths = sorted(len(prompt) for prompt in all_prompts)
    body = (
        f"`{COMMAND}` — SmolLM2-135M-Instruct (Q4_1 GGUF imported), {len(QUESTIONS)} short chat "
        f"prompts ({prompt_lengths[0]}-{prompt_lengths[-1]} tokens with the template), greedy, "
        f"up to {MAX_TOKENS} tokens. Greedy answers equal to mlx-lm's generate_step with the "
        f"same kv_bits, kv_group_size={GROUP_SIZE} and quantized_kv_start:\n\n"
        + equality.rstrip()
        + "\n\nDivergence from full precision, teacher-forced along full precision's greedy "
        "answers (mlx-lm's own caches, quantized by its maybe_quantize_kv_cache after each "
        "pass; 'from the first token': quantized before the prompt is read, what tandem did "
        "before --quantized-kv-start; a start of 16 falls inside the prompt but its last "
        "token, one pass, so it quantizes where 0 does):\n\n" + diverging
    )
    write_section(HEADING, body)


if __name__ == "__main__":
    main()
