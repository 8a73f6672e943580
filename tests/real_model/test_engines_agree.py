"""SmolLM2-135M-Instruct split over processes on 127.0.0.1 gives mlx-lm's own greedy tokens: a
two-stage sealed pipeline and a three-rank tensor-parallel ring (9 heads over 3 KV heads: two
ranks cannot split them, and the planner fails tp=2 closed to single), speculating by prompt
lookup."""

from __future__ import annotations

from pathlib import Path

import pytest

from discovery.cluster_key import generate_key
from engines.core.engine import Engine
from engines.core.runner import EngineRunner
from engines.model.info import inspect_model
from engines.tensor_parallel import TensorParallelEngine, loopback_ring_specs
from planner import NodeResources, Parallelism, allocate_layers, plan_cluster
from tests.helpers.engine import run_one
from tests.helpers.pipeline import make_engine, start_workers, stop_workers
from tests.helpers.real_model import QUESTIONS, Greedy, engine_request
from tests.helpers.tensor_parallel import start_rank, stop_processes

pytestmark = pytest.mark.cluster

GIB = 1024**3
# A real model's prefill on a shared 2-core machine: minutes of slack, not the demo's seconds.
LOAD_TIMEOUT_S = 180.0
STEP_TIMEOUT_S = 120.0
DRAFTED = 4  # prompt-lookup tokens drafted per step (--num-draft-tokens)


def assert_mlx_lm_tokens(engine: Engine, expected: list[Greedy]) -> None:
    """Every question, alone, through a runner on `engine`: mlx-lm's tokens, text and ending."""
    runner = EngineRunner(engine)
    try:
        runner.start(LOAD_TIMEOUT_S)
        for question, answer in zip(QUESTIONS, expected, strict=True):
            got = run_one(runner, engine_request(engine.tokenizer, question))
            assert tuple(got.tokens) == answer.tokens, question.text
            assert (got.text, got.finish) == (answer.text, answer.finish), question.text
    finally:
        runner.close()


def test_a_two_stage_pipeline_gives_mlx_lm_greedy_tokens(
    smollm2_dir: Path, mlx_lm_answers: list[Greedy], tmp_path: Path
) -> None:
    ranges = allocate_layers(30, [8 * GIB, 8 * GIB])
    assert [len(layers) for layers in ranges] == [15, 15]
    key = generate_key()
    listener, workers = start_workers(
        smollm2_dir, ranges, key, tmp_path, read_timeout_s=STEP_TIMEOUT_S
    )
    engine = make_engine(
        smollm2_dir, ranges, key, listener, workers, token_timeout_s=STEP_TIMEOUT_S,
        most_drafted=DRAFTED,
    )  # fmt: skip
    try:
        assert_mlx_lm_tokens(engine, mlx_lm_answers)
        speculation = engine.info().detail["speculation"]
        assert speculation["accepted"] > 0, speculation  # drafts checked in one trip down
    finally:
        engine.close()
        stop_workers(workers)


def test_three_tensor_parallel_ranks_give_mlx_lm_greedy_tokens(
    smollm2_dir: Path, mlx_lm_answers: list[Greedy]
) -> None:
    # with prompt lookup on every rank ("The capital of France is ..." drafts from the question)
    specs = loopback_ring_specs(
        3, smollm2_dir, stall_timeout_s=STEP_TIMEOUT_S, most_drafted=DRAFTED
    )
    ranks = [start_rank(spec) for spec in specs[1:]]
    lost: list[str] = []
    engine = TensorParallelEngine(
        smollm2_dir,
        specs[0],
        on_lost=lost.append,
        load_timeout_s=LOAD_TIMEOUT_S,
        token_timeout_s=STEP_TIMEOUT_S,
    )
    try:
        assert_mlx_lm_tokens(engine, mlx_lm_answers)
        assert not lost
        speculation = engine.info().detail["speculation"]
        assert speculation["accepted"] > 0, speculation  # drafts checked in one lockstep pass
    finally:
        engine.close()
        stop_processes(ranks)


def test_tp_over_two_ranks_fails_closed_to_single_and_three_ranks_split(
    smollm2_dir: Path,
) -> None:
    shape = inspect_model(smollm2_dir).to_shape()
    nodes = [
        NodeResources(f"node{rank}", f"10.0.0.{rank + 1}", 8 * GIB, ("ring",)) for rank in range(3)
    ]
    two = plan_cluster(Parallelism.TP, shape, nodes[:2], collective="ring")
    assert (two.decision.chosen, two.decision.failed_closed) == (Parallelism.SINGLE, True)
    assert "attention heads 9 do not divide evenly across worldSize=2" in two.decision.reason
    assert "KV heads 3 do not divide evenly across worldSize=2" in two.decision.reason
    three = plan_cluster(Parallelism.TP, shape, nodes, collective="ring")
    assert (three.decision.chosen, three.refusal) == (Parallelism.TP, None)
