"""--kv-bits in the single engine: mlx-lm's own greedy tokens with the same kv_bits, group size
and quantized_kv_start (quantizing from the first pass, mid-prompt, mid-decode, just before a
prompt's last token), alone or in a batch, and a model it cannot quantize refused at load."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.core.engine_options import EngineOptions
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.single.engine import SingleEngine
from errors import EngineError
from tests.helpers.engine import run_all, run_one
from tests.helpers.kv_reference import KV_PROMPTS
from tests.helpers.kv_reference import mlx_lm_tokens as reference_tokens

LOAD_TIMEOUT_S = 120
MAX_TOKENS = 24
CHUNK = 16  # the engine's prefill chunk, mlx-lm's prefill_step_size
PROMPTS = KV_PROMPTS
# 0: after the first pass; 20: mid-prompt (after the 40-token prompt's chunk ending at 32) and
# mid-decode (the short prompts); 4: after the 5-token prompt's first 4, before its last
STARTS = (0, 20, 4)


def mlx_lm_tokens(model_dir: Path, bits: int | None, start: int) -> list[list[int]]:
    return reference_tokens(model_dir, bits, start, MAX_TOKENS, CHUNK, PROMPTS)


@pytest.fixture(scope="module", params=[(8, 0), (4, 0), (8, 20), (4, 20), (4, 4)])
def quantized(request: pytest.FixtureRequest, demo_model_dir: Path) -> Iterator[EngineRunner]:
    bits, start = request.param
    engine = SingleEngine(
        demo_model_dir, EngineOptions(prefill_chunk=CHUNK, kv_bits=bits, quantized_kv_start=start)
    )
    runner = EngineRunner(engine, max_batch=4)
    runner.start(LOAD_TIMEOUT_S)
    yield runner
    runner.close()


def requests() -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", tuple(p), MAX_TOKENS) for i, p in enumerate(PROMPTS)]


def test_greedy_tokens_equal_mlx_lms_with_the_same_quantization(quantized, demo_model_dir):
    engine = quantized.engine
    alone = [run_one(quantized, request).tokens for request in requests()]
    assert alone == mlx_lm_tokens(
        demo_model_dir, engine.options.kv_bits, engine.options.quantized_kv_start
    )
    together = run_all(quantized, requests())
    assert [outcome.tokens for outcome in together] == alone
    detail = quantized.engine.info().detail
    assert (detail["kv_bits"], detail["quantized_kv_start"]) == (
        engine.options.kv_bits,
        engine.options.quantized_kv_start,
    )


def test_the_threshold_matters_so_the_comparison_means_something(demo_model_dir):
    """4-bit KV from the first pass, from mid-prompt, and never (past the answers) all differ
    from mlx-lm's unquantized answers: quantizing when mlx-lm does is what makes them equal."""
    unquantized = mlx_lm_tokens(demo_model_dir, None, 0)
    answers = {start: mlx_lm_tokens(demo_model_dir, 4, start) for start in (0, 20, 1000)}
    assert answers[1000] == unquantized
    assert answers[0] != unquantized and answers[20] != unquantized
    assert answers[0] != answers[20]


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
    engine = SingleEngine(demo_model_factory(arch=arch, layers=2), EngineOptions(kv_bits=8))
    with pytest.raises(EngineError, match=reason):
        engine.load()
    engine.close()
