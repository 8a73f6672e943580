"""--kv-bits on tp=2 ranks and on pp=2 stages: the same tokens as the single engine with the
same quantized KV cache, for a batch of prompts of different lengths."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from discovery.cluster_key import generate_key
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.single.engine import SingleEngine
from engines.tensor_parallel.engine import TensorParallelEngine
from engines.tensor_parallel.group import loopback_ring_specs
from planner import allocate_layers
from tests.helpers.engine import run_all
from tests.helpers.pipeline import make_engine, start_workers, stop_workers
from tests.helpers.tensor_parallel import start_rank, stop_processes

pytestmark = pytest.mark.cluster

LOAD_TIMEOUT_S = 120
BITS = 4
PROMPTS = ([5, 60, 61, 62, 63], [7, 100, 200, 300, 41, 42, 43, 44] * 5, [9, 500, 17])


def requests() -> list[GenerationRequest]:
    return [GenerationRequest(f"q{i}", tuple(p), 20) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def single_tokens(demo_model_dir: Path) -> Iterator[list[list[int]]]:
    runner = EngineRunner(SingleEngine(demo_model_dir, kv_bits=BITS), max_batch=4)
    runner.start(LOAD_TIMEOUT_S)
    try:
        yield [outcome.tokens for outcome in run_all(runner, requests())]
    finally:
        runner.close()


def test_tp_2_ranks_with_kv_bits_equal_single(demo_model_dir: Path, single_tokens):
    specs = loopback_ring_specs(2, demo_model_dir, kv_bits=BITS)
    ranks = [start_rank(spec) for spec in specs[1:]]
    engine = TensorParallelEngine(demo_model_dir, specs[0], load_timeout_s=LOAD_TIMEOUT_S)
    runner = EngineRunner(engine, max_batch=4)
    try:
        runner.start(LOAD_TIMEOUT_S)
        assert [o.tokens for o in run_all(runner, requests())] == single_tokens
        assert engine.info().detail["kv_bits"] == BITS
    finally:
        runner.close()
        stop_processes(ranks)


def test_pp_2_stages_with_kv_bits_equal_single(demo_model_dir: Path, tmp_path: Path, single_tokens):
    key = generate_key()
    ranges = allocate_layers(4, [8, 8])
    options = {"kv_bits": BITS}
    listener, workers = start_workers(demo_model_dir, ranges, key, tmp_path, stage_options=options)
    engine = make_engine(
        demo_model_dir, ranges, key, listener, workers, prefill_chunk=16, **options
    )
    runner = EngineRunner(engine, max_batch=4)
    try:
        runner.start(LOAD_TIMEOUT_S)
        assert [o.tokens for o in run_all(runner, requests())] == single_tokens
        assert engine.info().detail["kv_bits"] == BITS
    finally:
        runner.close()
        engine.close()
        stop_workers(workers)
