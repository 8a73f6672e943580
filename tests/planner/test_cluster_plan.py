"""Planning against live cluster resources: decision, memory fit, fallbacks and refusals."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from planner import (
    ClusterPlan,
    NodeFit,
    NodeResources,
    Parallelism,
    PlanError,
    format_bytes,
    plan_cluster,
    single_need,
    stage_need,
    tp_need_per_rank,
)
from tests.helpers.planning import MB, SHAPE

AUTO, TP, PP, SINGLE = Parallelism.AUTO, Parallelism.TP, Parallelism.PP, Parallelism.SINGLE
CONTEXT = 512  # with SHAPE: exactly 1 MB of KV cache per layer

UNTIED = replace(SHAPE, weight_bytes=38 * MB, tied_embeddings=False, head_bytes=4 * MB)


def node(node_id: str, memory_mb: float, *backends: str) -> NodeResources:
    return NodeResources(node_id, f"10.0.0.{ord(node_id[-1])}", int(memory_mb * MB), backends)


def plan(choice: Parallelism, *nodes: NodeResources, collective: str | None = None) -> ClusterPlan:
    return plan_cluster(choice, SHAPE, nodes, collective=collective, context_tokens=CONTEXT)


# ---- the memory model -------------------------------------------------------------------


def test_shape_sizes() -> None:
    assert SHAPE.layer_bytes == MB
    assert UNTIED.layer_bytes == MB
    assert SHAPE.kv_bytes_per_token_per_layer == 2048


@pytest.mark.parametrize(
    ("need", "expected_mb"),
    [
        pytest.param(lambda: single_need(SHAPE, CONTEXT, 0.0), 66, id="single"),
        pytest.param(lambda: tp_need_per_rank(SHAPE, 2, CONTEXT, 0.0), 34, id="tp-2-embed-whole"),
        pytest.param(lambda: tp_need_per_rank(SHAPE, 4, CONTEXT, 0.0), 18, id="tp-4"),
        pytest.param(
            lambda: stage_need(SHAPE, range(0, 16), True, False, CONTEXT, 0.0),
            34,
            id="first-stage-embedding",
        ),
        pytest.param(
            lambda: stage_need(SHAPE, range(8, 16), False, False, CONTEXT, 0.0),
            16,
            id="middle-stage",
        ),
        pytest.param(
            lambda: stage_need(SHAPE, range(16, 32), False, True, CONTEXT, 0.0),
            34,
            id="last-stage-tied-copy",
        ),
        pytest.param(
            lambda: stage_need(UNTIED, range(16, 32), False, True, CONTEXT, 0.0),
            36,
            id="last-stage-untied-head",
        ),
        pytest.param(
            lambda: stage_need(SHAPE, range(0, 32), True, True, CONTEXT, 0.0),
            66,
            id="lone-stage-tied-once",
        ),
        pytest.param(lambda: single_need(SHAPE, 0, 0.5), 51, id="headroom-no-context"),
    ],
)
def test_memory_needs(need: Callable[[], int], expected_mb: int) -> None:
    assert need() == expected_mb * MB


@pytest.mark.parametrize(
    ("value", "text"),
    [
        pytest.param(0, "0 B", id="zero"),
        pytest.param(1023, "1023 B", id="bytes"),
        pytest.param(1536, "1.5 KB", id="kilobytes"),
        pytest.param(int(1.2 * MB), "1.2 MB", id="megabytes"),
        pytest.param(16 * 1024**3, "16.0 GB", id="gigabytes"),
        pytest.param(-2 * MB, "-2.0 MB", id="negative"),
    ],
)
def test_format_bytes(value: int, text: str) -> None:
    assert format_bytes(value) == text


def test_node_fit_describes_need_and_availability() -> None:
    fit = NodeFit("node-b", int(1.2 * MB), int(0.9 * MB))
    assert not fit.fits
    assert fit.describe() == "node-b: needs 1.2 MB, has 0.9 MB"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        pytest.param({"num_layers": 0}, "num_layers=0", id="no-layers"),
        pytest.param({"kv_heads": 0}, "kv_heads=0", id="no-kv-heads"),
        pytest.param({"embedding_bytes": -1}, "embedding_bytes=-1", id="negative-bytes"),
        pytest.param({"weight_bytes": MB}, "smaller than its embedding", id="weights-too-small"),
    ],
)
def test_model_shape_rejects_impossible_sizes(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        replace(SHAPE, **changes)


# ---- plans --------------------------------------------------------------------------------


def test_equal_nodes_with_ring_accepted_plan_tp() -> None:
    result = plan(AUTO, node("node-a", 64, "ring"), node("node-b", 64, "ring"), collective="ring")
    assert result.decision.chosen is TP
    assert result.decision.reason.startswith("auto -> tp")
    assert result.ranks == ("node-a", "node-b")
    assert result.backend == "ring"
    assert result.stages == ()
    assert [fit.need_bytes for fit in result.fits] == [tp_need_per_rank(SHAPE, 2, CONTEXT)] * 2
    assert result.refusal is None


def test_jaccl_everywhere_needs_no_flag() -> None:
    result = plan(AUTO, node("node-a", 64, "jaccl", "ring"), node("node-b", 64, "jaccl"))
    assert (result.decision.chosen, result.backend) == (TP, "jaccl")


@pytest.mark.parametrize(
    "collective",
    [pytest.param(None, id="no-flag"), pytest.param("jaccl", id="jaccl-required")],
)
def test_ring_without_the_operator_flag_plans_pp(collective: str | None) -> None:
    nodes = (node("node-a", 64, "ring"), node("node-b", 64, "ring"))
    result = plan(AUTO, *nodes, collective=collective)
    assert result.decision.chosen is PP
    assert result.decision.reason == "auto -> pp: distributed group unavailable"
    assert [stage.layers for stage in result.stages] == [range(0, 16), range(16, 32)]
    assert result.backend is None
    assert result.refusal is None
    backend_check = next(c for c in result.checks if c.name == "collective backend")
    assert not backend_check.passed
    assert "jaccl on 0/2 nodes (missing on node-a, node-b)" in backend_check.detail


def test_unequal_memory_overflowing_tp_shard_falls_back_to_proportional_pp() -> None:
    result = plan(AUTO, node("node-a", 80, "jaccl"), node("node-b", 30, "jaccl"))
    assert result.decision.chosen is PP
    assert result.decision.reason == (
        "auto -> pp: equal tp shards need 37.4 MB per node but node-b has 30.0 MB; "
        "layers split in proportion to memory"
    )
    assert [stage.layers for stage in result.stages] == [range(0, 23), range(23, 32)]
    assert [stage.need_bytes for stage in result.stages] == [
        stage_need(SHAPE, range(0, 23), True, False, CONTEXT),
        stage_need(SHAPE, range(23, 32), False, True, CONTEXT),
    ]
    assert all(stage.fits for stage in result.stages)
    assert result.refusal is None
    assert not next(c for c in result.checks if c.name == "tp memory").passed


def test_explicit_tp_that_does_not_fit_is_refused_not_downgraded() -> None:
    result = plan(TP, node("node-a", 80, "jaccl"), node("node-b", 30, "jaccl"))
    assert result.decision.chosen is TP
    assert result.refusal == (
        "tp does not fit: equal tp shards need 37.4 MB per node but node-b has 30.0 MB "
        "(per node: node-a: needs 37.4 MB, has 80.0 MB; "
        "node-b: needs 37.4 MB, has 30.0 MB (short by 7.4 MB))"
    )


def test_explicit_tp_missing_capability_fails_closed_to_single() -> None:
    shape = replace(SHAPE, attention_heads=15)
    result = plan_cluster(
        TP,
        shape,
        [node("node-a", 128, "jaccl"), node("node-b", 128, "jaccl")],
        context_tokens=CONTEXT,
    )
    assert result.decision.chosen is SINGLE
    assert result.decision.failed_closed
    assert "attention heads 15 do not divide evenly across worldSize=2" in result.decision.reason
    assert result.ranks == ("node-a",)
    assert result.refusal is None


@pytest.mark.parametrize(
    ("choice", "nodes", "chosen", "words"),
    [
        pytest.param(
            AUTO,
            [node("node-a", 20, "jaccl"), node("node-b", 20, "jaccl")],
            PP,
            [
                "nothing fits",
                "node-a: needs 37.4 MB, has 20.0 MB (short by 17.4 MB)",
                "node-b: needs 37.4 MB, has 20.0 MB",
            ],
            id="auto-neither-tp-nor-pp-fits",
        ),
        pytest.param(
            PP,
            [node("node-a", 20), node("node-b", 40)],
            PP,
            ["pipeline stages do not fit", "node-a: needs", "has 20.0 MB", "has 40.0 MB"],
            id="explicit-pp-stage-overflows",
        ),
        pytest.param(
            AUTO,
            [node("node-a", 50)],
            SINGLE,
            ["model needs 72.6 MB but node-a has 50.0 MB", "short by 22.6 MB"],
            id="single-too-small",
        ),
    ],
)
def test_nothing_fits_is_a_refusal_with_per_node_numbers(
    choice: Parallelism, nodes: list[NodeResources], chosen: Parallelism, words: list[str]
) -> None:
    result = plan(choice, *nodes)
    assert result.decision.chosen is chosen
    assert result.refusal is not None
    for word in words:
        assert word in result.refusal


def test_more_nodes_than_layers_refuses_pp() -> None:
    shape = replace(SHAPE, num_layers=2, weight_bytes=4 * MB)
    nodes = [node(f"node-{letter}", 64) for letter in "abc"]
    result = plan_cluster(PP, shape, nodes)
    assert result.refusal is not None
    assert "3 stages but the model has 2 layers" in result.refusal


def test_lone_node_plans_single_whatever_was_asked() -> None:
    result = plan(TP, node("node-a", 128, "jaccl"))
    assert result.decision.chosen is SINGLE
    assert not result.decision.failed_closed
    assert result.fits == (NodeFit("node-a", single_need(SHAPE, CONTEXT), 128 * MB),)


def test_to_dict_is_json_ready() -> None:
    result = plan(AUTO, node("node-a", 80, "jaccl"), node("node-b", 30, "jaccl"))
    data = json.loads(json.dumps(result.to_dict()))
    assert data["decision"]["chosen"] == "pp"
    assert [stage["layers"] for stage in data["stages"]] == [[0, 23], [23, 32]]
    assert data["refusal"] is None
    kv_check = {
        "name": "KV heads",
        "passed": True,
        "detail": "KV heads 8 divide evenly across worldSize=2",
    }
    assert kv_check in data["checks"]


def test_describe_prints_every_rule_the_choice_and_the_stages() -> None:
    result = plan(AUTO, node("node-a", 80, "jaccl"), node("node-b", 30, "jaccl"))
    lines = result.describe()
    assert lines[0] == "PASS world size: worldSize=2 (tp and pp need at least 2)"
    assert "PASS collective backend: jaccl on 2/2 nodes" in lines
    assert any(line.startswith("FAIL tp memory: equal tp shards need 37.4 MB") for line in lines)
    assert any(line.startswith("chosen: pp (auto -> pp:") for line in lines)
    assert any(line.startswith("stage 1 node-b: layers 23-31 (9 layers)") for line in lines)


@pytest.mark.parametrize(
    ("nodes", "collective", "message"),
    [
        pytest.param([], None, "no nodes", id="no-nodes"),
        pytest.param([node("node-a", 8), node("node-a", 8)], None, "appears twice", id="dup-id"),
        pytest.param([node("node-a", 0)], None, "node-a reports 0 bytes", id="no-memory"),
        pytest.param([node("node-a", 8)], "nccl", "unknown collective 'nccl'", id="collective"),
    ],
)
def test_invalid_input_raises_plan_error(
    nodes: list[NodeResources], collective: str | None, message: str
) -> None:
    with pytest.raises(PlanError, match=message):
        plan_cluster(AUTO, SHAPE, nodes, collective=collective)


def test_auto_leaves_out_a_member_too_small_for_any_share() -> None:
    """Two large machines can serve alone; the small one sits out, named with its numbers."""
    result = plan(AUTO, node("node-a", 200), node("node-b", 200), node("node-c", 2))
    assert result.refusal is None
    assert result.ranks == ("node-a", "node-b")
    assert result.decision.chosen is PP
    assert result.decision.reason.startswith("auto without node-c (its share needs ")
    assert "it has 2.0 MB)" in result.decision.reason
    assert [stage.node_id for stage in result.stages] == ["node-a", "node-b"]


def test_members_sit_out_smallest_first_until_the_rest_fits() -> None:
    result = plan(
        AUTO, node("node-a", 200, "jaccl"), node("node-b", 2, "jaccl"), node("node-c", 3, "jaccl")
    )
    assert result.refusal is None
    assert result.ranks == ("node-a",)
    assert result.decision.chosen is SINGLE
    assert result.decision.reason.startswith("auto without node-b (")
    assert "; auto without node-c (" in result.decision.reason


@pytest.mark.parametrize(
    ("choice", "nodes"),
    [
        pytest.param(PP, [node("node-a", 200), node("node-b", 200), node("node-c", 2)], id="pp"),
        pytest.param(TP, [node("node-a", 200, "jaccl"), node("node-c", 2, "jaccl")], id="tp"),
    ],
)
def test_an_explicit_choice_never_drops_a_member(
    choice: Parallelism, nodes: list[NodeResources]
) -> None:
    result = plan(choice, *nodes)
    assert result.decision.chosen is choice
    assert result.refusal is not None
    assert "node-c: needs" in result.refusal


def test_the_coordinator_never_sits_out() -> None:
    result = plan(AUTO, node("node-a", 2), node("node-b", 200), node("node-c", 200))
    assert result.refusal is not None
    assert "node-a" in result.refusal
