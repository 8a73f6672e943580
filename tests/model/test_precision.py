"""Half-precision models on the CPU: upcast to float32 when the plan counted it, else as stored."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from engines.cluster.planning import PlanSettings, plan_nodes
from engines.core.engine_options import EngineOptions
from engines.core.runner import EngineRunner
from engines.model.info import inspect_model
from engines.single.engine import SingleEngine
from planner import Parallelism
from tests.helpers.engine import make_request, run_one
from tests.helpers.supervision import Members, ScriptedEngine, make_supervisor


def dtypes_of(engine: SingleEngine) -> set:
    return {value.dtype for _, value in tree_flatten(engine.model.parameters())}


def test_a_bfloat16_model_computes_in_float32_on_the_cpu(demo_model_factory):
    model_dir = demo_model_factory(dtype="bfloat16")
    results = {}
    for upcast in (False, True):
        runner = EngineRunner(SingleEngine(model_dir, EngineOptions(upcast=upcast)))
        runner.start(120)
        try:
            assert runner.engine.info().detail["compute_dtype"] == (
                "float32" if upcast else "bfloat16"
            )
            assert dtypes_of(runner.engine) == ({mx.float32} if upcast else {mx.bfloat16})
            results[upcast] = run_one(
                runner, make_request(runner.engine, "The quick brown fox", 24)
            )
        finally:
            runner.close()
    assert results[True].finish in ("length", "stop") and len(results[True].tokens) >= 8
    # Same weights, finer arithmetic: the greedy text starts out the same.
    assert results[True].tokens[:4] == results[False].tokens[:4]


def test_the_plan_counts_float32_weights_and_falls_back_when_they_do_not_fit(demo_model_factory):
    model_dir = Path(demo_model_factory(dtype="bfloat16"))
    facts = inspect_model(model_dir)
    assert facts.can_upcast
    assert facts.to_shape(float32=True).weight_bytes == 2 * facts.to_shape().weight_bytes
    supervisor = make_supervisor(model_dir, lambda plan: ScriptedEngine(), Members())
    plan = supervisor.make_plan()
    assert plan.compute_dtype == "float32"
    assert "compute precision on every node: float32" in plan.describe()
    # A node that fits the model as stored but not upcast: the plan keeps half precision.
    as_stored = replace(supervisor.plan_settings, cpu_float32=False)
    need_native = plan_nodes(facts, as_stored, [supervisor.coordinator()], []).fits[0]
    small = type(supervisor.coordinator())(
        "coordinator", "127.0.0.1", int(need_native.need_bytes * 1.2), ("ring",)
    )
    supervisor.coordinator = lambda: small
    supervisor.membership = None
    plan = supervisor.make_plan()
    assert plan.refusal is None and plan.compute_dtype == "as stored"


def test_a_full_batch_in_half_precision_comes_before_a_smaller_one_in_float32(demo_model_factory):
    """--max-batch unset (planner/batch.py): a full batch as stored is kept over fewer
    sequences upcast; when neither precision holds a full batch, float32 at the largest batch
    that fits (the CPU's fast path), fewer sequences than half precision would hold."""
    from planner import NodeResources, single_need

    facts = inspect_model(Path(demo_model_factory(dtype="bfloat16")))
    context = 8192
    settings = PlanSettings(Parallelism.SINGLE, None, context, 4, 16, shrink_batch=True)
    half, upcast = facts.to_shape(), facts.to_shape(float32=True)

    def plan_on(memory: int, float32: bool = True):
        node = NodeResources("c", "127.0.0.1", memory, ())
        return plan_nodes(facts, replace(settings, cpu_float32=float32), [node], [])

    full_as_stored = plan_on(single_need(half, 16 * context))
    assert (full_as_stored.compute_dtype, full_as_stored.batch_capacity) == ("as stored", 16)
    shrunk = plan_on(single_need(upcast, 3 * context))
    assert (shrunk.compute_dtype, shrunk.batch_capacity, shrunk.max_batch) == ("float32", 3, 16)
    assert plan_on(single_need(upcast, 3 * context), float32=False).batch_capacity > 3


def test_float32_models_are_left_alone(demo_model_dir):
    assert not inspect_model(demo_model_dir).can_upcast
