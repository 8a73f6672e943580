"""Other group shapes and refusals: three ranks, a model two ranks cannot split, an invalid
worker spec."""

from __future__ import annotations

import json
import subprocess

import pytest

from engines.core.runner import EngineRunner
from engines.single.engine import SingleEngine
from engines.tensor_parallel import TensorParallelEngine, loopback_ring_specs
from errors import EngineError
from tests.helpers.engine import make_request, run_all
from tests.helpers.tensor_parallel import (
    LOAD_TIMEOUT_S,
    PROJECT_ROOT,
    PROMPTS,
    WORKER,
    close_cluster,
    open_cluster,
    start_rank,
    stop_processes,
)

pytestmark = pytest.mark.cluster

# -- other group shapes and refusals -------------------------------------------------------


def test_three_ranks_equal_single(demo_model_factory):
    model_dir = demo_model_factory(heads=6, kv_heads=3, layers=2)
    single = EngineRunner(SingleEngine(model_dir))
    single.start(LOAD_TIMEOUT_S)
    cluster = open_cluster(model_dir, world_size=3)
    tp = EngineRunner(cluster.engine)
    tp.start(LOAD_TIMEOUT_S)
    try:
        requests = [make_request(single.engine, prompt, 24) for prompt in PROMPTS]
        expected = run_all(single, requests)
        assert [o.tokens for o in run_all(tp, requests)] == [o.tokens for o in expected]
        assert cluster.engine.info().world_size == 3
    finally:
        tp.close()
        close_cluster(cluster)
        single.close()


def test_a_model_with_odd_heads_fails_to_load_with_the_reason(odd_heads_model_dir):
    specs = loopback_ring_specs(2, odd_heads_model_dir)
    rank1 = start_rank(specs[1])
    engine = TensorParallelEngine(odd_heads_model_dir, specs[0], load_timeout_s=LOAD_TIMEOUT_S)
    try:
        with pytest.raises(EngineError, match="divisible by 2.*3 attention heads"):
            engine.load()
        failed = json.loads(rank1.stdout.readline())
        assert failed["event"] == "failed" and "3 KV heads" in failed["reason"]
        assert rank1.wait(10) != 0
        assert not engine.healthy()
    finally:
        engine.close()
        stop_processes([rank1])


def test_an_invalid_spec_is_reported_on_stdout(tmp_path):
    process = subprocess.run(
        WORKER,
        input=json.dumps({"rank": 3, "world_size": 2, "backend": "ring"}) + "\n",
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=30,
    )
    event = json.loads(process.stdout)
    assert process.returncode == 2
    assert event["event"] == "failed" and "rank 3 is outside a world of size 2" in event["reason"]
