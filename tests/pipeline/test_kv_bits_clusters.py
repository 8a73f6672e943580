"""--kv-bits on tp=2 ranks and on pp=2 stages: mlx-lm's own greedy tokens with the same kv_bits
and quantized_kv_start, for a batch of prompts of different lengths."""

from __future__ import annotations

from pathlib import Path

import pytest

from discovery.cluster_key import generate_key
from engines.core.engine_options import EngineOptions
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.tensor_parallel.engine import TensorParallelEngine
from engines.tensor_parallel.group import loopback_ring_specs
from planner import allocate_layers
from tests.helpers.engine import run_all, run_one
from tests.helpers.kv_reference import KV_PROMPTS, mlx_lm_tokens
from tests.helpers.pipeline import make_engine, start_workers, stop_workers
from tests.helpers.tensor_parallel import start_rank, stop_processes

pytestmark = pytest.mark.cluster

LOAD_TIMEOUT_S = 120
MAX_TOKENS = 20
CHUNK = 16


def requests() -> list[GenerationRequest]:
    return [GenerationRequest(f"q{i}", tuple(p), MAX_TOKENS) for i, p in enumerate(KV_PROMPTS)]


def test_tp_2_ranks_with_kv_bits_equal_mlx_lm(demo_model_dir: Path):
    bits, start = 4, 20  # mid-prompt (the 40-token prompt) and mid-decode (the others)
    options = {"kv_bits": bits, "quantized_kv_start": start, "prefill_chunk": CHUNK}
    specs = loopback_ring_specs(2, demo_model_dir, EngineOptions(**options))
    ranks = [start_rank(spec) for spec in specs[1:]]
    engine = TensorParallelEngine(demo_model_dir, specs[0], load_timeout_s=LOAD_TIMEOUT_S)
    runner = EngineRunner(engine, max_batch=4)
    try:
        runner.start(LOAD_TIMEOUT_S)
        expected = mlx_lm_tokens(demo_model_dir, bits, start, MAX_TOKENS, CHUNK)
        assert [o.tokens for o in run_all(runner, requests())] == expected
        detail = engine.info().detail
        assert (detail["kv_bits"], detail["quantized_kv_start"]) == (bits, start)
    finally:
        runner.close()
        stop_processes(ranks)


# 4 from 4: the 5-token prompt quantizes after its first 4 tokens, so its last one goes alone;
# (the 40-token prompt mid-prompt, the 3-token one mid-decode); 8 from 0: after the first pass
@pytest.mark.parametrize(("bits", "start"), [(4, 4), (8, 0)])
def test_pp_2_stages_with_kv_bits_equal_mlx_lm(
    demo_model_dir: Path, tmp_path: Path, bits: int, start: int
):
    key = generate_key()
    ranges = allocate_layers(4, [8, 8])
    options = {"kv_bits": bits, "quantized_kv_start": start}
    listener, workers = start_workers(demo_model_dir, ranges, key, tmp_path, stage_options=options)
    engine = make_engine(
        demo_model_dir, ranges, key, listener, workers, prefill_chunk=CHUNK, **options
    )
    runner = EngineRunner(engine, max_batch=4)
    try:
        runner.start(LOAD_TIMEOUT_S)
        expected = mlx_lm_tokens(demo_model_dir, bits, start, MAX_TOKENS, CHUNK)
        assert [run_one(runner, request).tokens for request in requests()] == expected
        assert [o.tokens for o in run_all(runner, requests())] == expected
        detail = engine.info().detail
        assert (detail["kv_bits"], detail["quantized_kv_start"]) == (bits, start)
    finally:
        runner.close()
        engine.close()
        stop_workers(workers)
