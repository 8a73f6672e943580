"""The batch a plan holds (planner/batch.py): a full --max-batch when it fits, else, with
--max-batch unset, the largest batch that fits, for single, pipeline stages and tp ranks alike;
refused only when one sequence does not fit, or when an explicit --max-batch does not."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from planner import NodeResources, Parallelism, plan_cluster, single_need, stage_need
from planner import tp_need_per_rank as tp_need
from planner.batch import BATCH_RULE, plan_batch
from planner.placement import ModelToPlace, place_models
from planner.relay import relayed
from tests.helpers.planning import MB, SHAPE

AUTO, TP, PP, SINGLE = Parallelism.AUTO, Parallelism.TP, Parallelism.PP, Parallelism.SINGLE
CONTEXT = 512  # with SHAPE: 1 MB of KV per layer per sequence, 32 MB over the model
MAX_BATCH = 16


def node(node_id: str, memory_mb: float) -> NodeResources:
    return NodeResources(node_id, f"10.0.0.{len(node_id)}", int(memory_mb * MB), ("ring",))


def way(choice: Parallelism, nodes: list[NodeResources], shape=SHAPE, collective=None):
    """plan_cluster at a batch, as serve plans one precision of the model."""
    return lambda batch: plan_cluster(
        choice, shape, nodes, collective=collective, context_tokens=CONTEXT, max_batch=batch
    )


def need_mb(need_bytes: int) -> float:
    return need_bytes / MB


# single: (34 + 32 b) MB x 1.1; a pp stage of 16 layers: (16 + 16 b + 2) MB x 1.1; a tp rank of
# two: (2 + 16 + 16 b) MB x 1.1. The memory each case gives holds 3 sequences, not 4.
@pytest.mark.parametrize(
    ("choice", "memory_mb", "collective", "need_at"),
    [
        pytest.param(SINGLE, [150], None, lambda b: single_need(SHAPE, b * CONTEXT), id="single"),
        pytest.param(
            PP,
            [80, 80],
            None,
            lambda b: stage_need(SHAPE, range(0, 16), True, False, b * CONTEXT),
            id="pp-each-stage-its-kv-share",
        ),
        pytest.param(
            TP, [80, 80], "ring", lambda b: tp_need(SHAPE, 2, b * CONTEXT), id="tp-each-rank"
        ),
    ],
)
def test_a_full_batch_that_does_not_fit_is_planned_as_the_largest_that_does(
    choice, memory_mb, collective, need_at
) -> None:
    nodes = [node(f"node-{index}", mb) for index, mb in enumerate(memory_mb)]
    memory = min(memory_mb) * MB
    assert need_at(3) <= memory < need_at(4)  # the case's arithmetic, checked
    plan = plan_batch([way(choice, nodes, collective=collective)], MAX_BATCH, shrink=True)
    assert plan.refusal is None and plan.decision.chosen is choice
    assert (plan.batch_capacity, plan.max_batch, plan.context_tokens) == (3, MAX_BATCH, CONTEXT)
    assert {fit.need_bytes for fit in plan.fits} == {need_at(3)}  # each node counts 3 of KV
    capacity = "batch capacity: 3 sequences x 512 tokens"
    assert plan.decision.reason.endswith(f"; {capacity} (a full batch of 16 does not fit)")
    check = plan.checks[-1]
    assert (check.name, check.passed) == (BATCH_RULE, True)
    full = way(choice, nodes, collective=collective)(MAX_BATCH)
    assert check.detail == (
        f"3 sequences x 512 tokens: a full batch of 16 does not fit ({full.refusal}); more "
        "requests wait in the queue"
    )
    assert (
        f"{capacity} of KV cache, counted in every node's need (a full batch of 16 does not "
        "fit; more requests wait their turn)"
    ) in plan.describe()
    data = json.loads(json.dumps(plan.to_dict()))
    assert (data["batch_capacity"], data["max_batch"], data["refusal"]) == (3, 16, None)


@pytest.mark.parametrize("shrink", [True, False], ids=["unset", "explicit"])
def test_a_full_batch_that_fits_is_planned_unchanged(shrink: bool) -> None:
    nodes = [node("a", 601)]  # 16 sequences: 600.6 MB
    plan = plan_batch([way(SINGLE, nodes)], MAX_BATCH, shrink)
    assert plan == way(SINGLE, nodes)(MAX_BATCH)
    assert (plan.batch_capacity, plan.max_batch) == (16, 16)
    assert BATCH_RULE not in [check.name for check in plan.checks]
    assert (
        "batch capacity: 16 sequences x 512 tokens of KV cache, counted in every node's need"
        in plan.describe()
    )


def test_one_sequence_that_does_not_fit_is_refused_with_its_own_numbers() -> None:
    plan = plan_batch([way(SINGLE, [node("a", 70)])], MAX_BATCH, shrink=True)  # 1: 72.6 MB
    assert plan.batch_capacity == 1
    assert plan.refusal == (
        "model needs 72.6 MB but a has 70.0 MB (short by 2.6 MB), even with one sequence of "
        "512 tokens"
    )


def test_an_explicit_max_batch_too_big_is_refused_naming_what_would_fit() -> None:
    nodes = [node("a", 150)]
    plan = plan_batch([way(SINGLE, nodes)], MAX_BATCH, shrink=False)
    assert plan.batch_capacity == 16
    assert plan.refusal == (
        "model needs 600.6 MB but a has 150.0 MB (short by 450.6 MB); --max-batch 16 was given, "
        "3 would fit (without --max-batch, serve plans the largest batch that fits)"
    )
    assert plan_batch([way(SINGLE, [node("a", 70)])], MAX_BATCH, shrink=False).refusal == (
        "model needs 600.6 MB but a has 70.0 MB (short by 530.6 MB)"  # not even one: as before
    )


@pytest.mark.parametrize("capacity", range(1, MAX_BATCH))
def test_the_largest_batch_that_fits_is_found_exactly(capacity: int) -> None:
    memory = single_need(SHAPE, capacity * CONTEXT)  # exactly `capacity` sequences' need
    nodes = [NodeResources("a", "10.0.0.1", memory, ())]
    assert plan_batch([way(SINGLE, nodes)], MAX_BATCH, True).batch_capacity == capacity


def test_a_refusal_that_is_not_memory_is_not_blamed_on_the_batch() -> None:
    nodes = [node(f"n{index:02}", 1000) for index in range(33)]  # 33 stages, 32 layers
    plan = plan_batch([way(PP, nodes)], MAX_BATCH, shrink=True)
    assert plan.refusal is not None and plan.refusal.startswith("pp needs at least one layer")
    assert "even with one sequence" not in plan.refusal


def test_auto_leaves_out_a_small_member_before_it_shrinks_the_batch() -> None:
    # single holds 16 on the coordinator; pp over both would hold fewer, small included
    nodes = [node("coordinator", 700), node("small", 20)]
    plan = plan_batch([way(AUTO, nodes, collective="ring")], MAX_BATCH, shrink=True)
    assert plan.ranks == ("coordinator",) and plan.batch_capacity == 16


FLOAT32 = replace(SHAPE, weight_bytes=68 * MB, embedding_bytes=4 * MB, head_bytes=4 * MB)
FLOAT32 = replace(FLOAT32, dtype_bytes=4)  # twice the weights and the KV


@pytest.mark.parametrize(
    ("memory_mb", "dtype_bytes", "capacity"),
    [
        pytest.param(1300, 4, 16, id="float32-full-batch"),
        pytest.param(700, 2, 16, id="own-precision-full-batch-before-a-smaller-float32-one"),
        pytest.param(300, 4, 3, id="neither-full-float32-shrunk-first"),  # 3 x 64 MB + 68 MB
        pytest.param(90, 2, 1, id="only-own-precision-holds-one"),
    ],
)
def test_a_full_batch_in_any_way_comes_before_a_smaller_one(
    memory_mb: int, dtype_bytes: int, capacity: int
) -> None:
    nodes = [node("a", memory_mb)]
    ways = [way(SINGLE, nodes, FLOAT32), way(SINGLE, nodes, SHAPE)]
    plan = plan_batch(ways, MAX_BATCH, shrink=True)
    assert plan.refusal is None
    assert plan.fits[0].need_bytes == single_need(
        FLOAT32 if dtype_bytes == 4 else SHAPE, capacity * CONTEXT
    )
    assert plan.batch_capacity == capacity


def test_a_placement_prefers_a_full_batch_on_more_machines_to_a_smaller_one() -> None:
    # single on c holds 1 sequence (2: 107.8 MB); tp over c and a holds all 4 (90.2 MB a rank)
    def plan(model: ModelToPlace, nodes: list[NodeResources], relay: bool = False):
        if relay:
            alone = plan(ModelToPlace(model.model_id, SINGLE), nodes[1:])
            return relayed(alone, nodes[0], SHAPE, 0.1)
        return plan_batch([way(model.choice, nodes, collective="ring")], 4, shrink=True)

    placement = place_models([ModelToPlace("m", AUTO)], [node("c", 100), node("a", 100)], plan)
    chosen = placement.plans["m"]
    assert chosen.decision.chosen is TP and chosen.batch_capacity == 4
    shrunk = [c for c in placement.candidates if c.plans["m"].batch_capacity < 4]
    assert shrunk and all(placement.candidates.index(c) > 0 for c in shrunk)
