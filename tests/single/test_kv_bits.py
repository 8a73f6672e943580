"""--kv-bits in the single engine: mlx-lm's own tokens with the same quantized KV cache, alone
or in a batch, and a model it cannot quantize refused at load."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.single.engine import SingleEngine
from planner.errors import EngineError
from tests.helpers.engine import run_all, run_one

LOAD_TIMEOUT_S = 120
MAX_TOKENS = 24
# different lengths, one longer than the engine's prefill chunk of 16
PROMPTS = ([5, 60, 61, 62, 63], [7, 100, 200, 300, 41, 42, 43, 44] * 5, [9, 500, 17])


def mlx_lm_tokens(model_dir: Path, bits: int) -> list[list[int]]:
    """mlx-lm's greedy tokens with its QuantizedKVCache in every layer from the first token
    (group size 32: the demo model's head size is 32)."""
    model, _ = load(str(model_dir))
    answers = []
    for prompt in PROMPTS:
        caches = [QuantizedKVCache(group_size=32, bits=bits) for _ in model.layers]
        steps = generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=MAX_TOKENS)
        answers.append([int(token) for token, _ in steps])
    return answers


@pytest.fixture(scope="module", params=[8, 4])
def quantized(request: pytest.FixtureRequest, demo_model_dir: Path) -> Iterator[EngineRunner]:
    engine = SingleEngine(demo_model_dir, prefill_chunk=16, kv_bits=request.param)
    runner = EngineRunner(engine, max_batch=4)
    runner.start(LOAD_TIMEOUT_S)
    yield runner
    runner.close()


def requests() -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", tuple(p), MAX_TOKENS) for i, p in enumerate(PROMPTS)]


def test_greedy_tokens_equal_mlx_lms_with_the_same_quantized_cache(quantized, demo_model_dir):
    bits = quantized.engine.kv_bits
    alone = [run_one(quantized, request).tokens for request in requests()]
    assert alone == mlx_lm_tokens(demo_model_dir, bits)
    together = run_all(quantized, requests())
    assert [outcome.tokens for outcome in together] == alone
    assert quantized.engine.info().detail["kv_bits"] == bits


def test_unquantized_tokens_differ_so_the_comparison_means_something(quantized, demo_model_dir):
    plain = EngineRunner(SingleEngine(demo_model_dir), max_batch=4)
    plain.start(LOAD_TIMEOUT_S)
    try:
        unquantized = [run_one(plain, request).tokens for request in requests()]
    finally:
        plain.close()
    if quantized.engine.kv_bits == 4:  # 8 bits may well give the same greedy tokens
        assert [run_one(quantized, r).tokens for r in requests()] != unquantized


@pytest.mark.parametrize(
    ("arch", "reason"),
    [
        ("gemma3_text", "plain KV caches in every layer; this model keeps RotatingKVCache"),
        ("deepseek_v3", "this model caches a compressed latent"),
    ],
)
def test_a_model_whose_caches_cannot_be_quantized_is_refused_at_load(
    demo_model_factory, arch: str, reason: str
):
    engine = SingleEngine(demo_model_factory(arch=arch, layers=2), kv_bits=8)
    with pytest.raises(EngineError, match=reason):
        engine.load()
    engine.close()
