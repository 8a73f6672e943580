"""mlx-lm's own greedy tokens with a quantized KV cache: what --kv-bits answers are held to."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

# different lengths, one longer than a prefill chunk of 16
KV_PROMPTS = ([5, 60, 61, 62, 63], [7, 100, 200, 300, 41, 42, 43, 44] * 5, [9, 500, 17])


def mlx_lm_tokens(
    model_dir: Path,
    bits: int | None,
    start: int,
    max_tokens: int,
    prefill_chunk: int,
    prompts: Sequence[Sequence[int]] = KV_PROMPTS,
    group_size: int = 32,  # the demo models' head size is 32
) -> list[list[int]]:
    """mlx-lm's greedy tokens for each prompt, generate_step quantizing the cache as it does
    (`bits` None: not at all), prefilling in chunks of `prefill_chunk`."""
    model, _ = load(str(model_dir))
    answers = []
    for prompt in prompts:
        steps = generate_step(
            mx.array(list(prompt)), model, max_tokens=max_tokens, prefill_step_size=prefill_chunk,
            kv_bits=bits, kv_group_size=group_size, quantized_kv_start=start,
        )  # fmt: skip
        answers.append([int(token) for token, _ in steps])
    return answers
