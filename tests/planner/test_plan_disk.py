"""The planner's disk rule: a node that lacks the model must have the disk to receive it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner import (
    DISK_MARGIN_BYTES,
    NodeResources,
    Parallelism,
    TransferSizes,
    plan_cluster,
)
from tests.helpers.planning import SHAPE

AUTO, TP, PP, SINGLE = Parallelism.AUTO, Parallelism.TP, Parallelism.PP, Parallelism.SINGLE
MB = 1024**2
CONTEXT = 512

# The planner tests' shape (32 layers of 1 MB, tied 2 MB embedding); 1 MB of config and
# tokenizer on disk.
TRANSFER = TransferSizes(SHAPE, 35 * MB)
MARGIN_MB = DISK_MARGIN_BYTES // MB  # 256


def node(node_id: str, free_mb: float | None, memory_mb: float = 1000, **held) -> NodeResources:
    free = None if free_mb is None else int(free_mb * MB)
    return NodeResources(
        node_id, f"10.0.0.{len(node_id)}", int(memory_mb * MB), ("jaccl",), free, **held
    )


COORD = node("coord", None, holds_model=True)


def plan(choice: Parallelism, *nodes: NodeResources, transfer=TRANSFER):
    return plan_cluster(choice, SHAPE, nodes, context_tokens=CONTEXT, transfer=transfer)


def test_transfer_sizes() -> None:
    assert TRANSFER.other_bytes == MB
    # a middle stage: its layers and the config; the first adds the embedding, the last
    # its own copy of the tied embedding, a lone stage holds it once
    assert TRANSFER.stage_bytes(range(8, 16), False, False) == 9 * MB
    assert TRANSFER.stage_bytes(range(0, 16), True, False) == 19 * MB
    assert TRANSFER.stage_bytes(range(16, 32), False, True) == 19 * MB
    assert TRANSFER.stage_bytes(range(0, 32), True, True) == 35 * MB
    untied = TransferSizes(
        replace(SHAPE, weight_bytes=38 * MB, tied_embeddings=False, head_bytes=4 * MB), 39 * MB
    )
    assert untied.stage_bytes(range(16, 32), False, True) == 21 * MB
    # a tp rank: its slice of the layers, the embedding whole, the config
    assert TRANSFER.rank_bytes(2) == 19 * MB
    assert TRANSFER.rank_bytes(4) == 11 * MB
    assert untied.rank_bytes(2) == 23 * MB


@pytest.mark.parametrize(
    ("choice", "agent", "check", "refusal"),
    [
        pytest.param(
            TP,
            node("a1", 200),
            "FAIL tp disk: a1 lacks its tp share (rank 1 of 2): needs 275.0 MB of disk to "
            "receive it, has 200.0 MB free (short by 75.0 MB)",
            "tp disk: a1 lacks its tp share (rank 1 of 2): needs 275.0 MB of disk to receive "
            "it, has 200.0 MB free (short by 75.0 MB)",
            id="tp-short",
        ),
        pytest.param(
            TP,
            node("a1", 300),
            "PASS tp disk: coord holds the model; a1 receives its tp share (rank 1 of 2): "
            "needs 275.0 MB, has 300.0 MB free",
            None,
            id="tp-fits",
        ),
        pytest.param(
            TP,
            node("a1", 1, holds_model=True),
            "PASS tp disk: coord holds the model; a1 holds the model",
            None,
            id="tp-holds",
        ),
        pytest.param(
            TP,
            node("a1", 1, held_ranks=((1, 2),)),
            "PASS tp disk: coord holds the model; a1 holds its tp share (rank 1 of 2)",
            None,
            id="tp-holds-its-share",
        ),
        pytest.param(
            TP,
            node("a1", 1, held_ranks=((1, 4),)),
            "FAIL tp disk: a1 lacks its tp share (rank 1 of 2): needs 275.0 MB of disk to "
            "receive it, has 1.0 MB free (short by 274.0 MB)",
            "tp disk: a1 lacks its tp share (rank 1 of 2): needs 275.0 MB of disk to "
            "receive it, has 1.0 MB free (short by 274.0 MB)",
            id="tp-holds-another-share",
        ),
        pytest.param(
            TP,
            node("a1", None),
            "PASS tp disk: coord holds the model; a1 receives its tp share (rank 1 of 2) "
            "(free disk not reported)",
            None,
            id="tp-not-reported",
        ),
        pytest.param(
            PP,
            node("a1", 200),
            "FAIL pp disk: a1 lacks layers 16-31 + head: needs 275.0 MB of disk to receive it, "
            "has 200.0 MB free (short by 75.0 MB)",
            "pp disk: a1 lacks layers 16-31 + head: needs 275.0 MB of disk to receive it, "
            "has 200.0 MB free (short by 75.0 MB)",
            id="pp-short-share",
        ),
        pytest.param(
            PP,
            node("a1", 200, held_stages=((16, 32),)),
            "PASS pp disk: coord holds layers 0-15; a1 holds layers 16-31 + head",
            None,
            id="pp-holds-its-share",
        ),
        pytest.param(
            PP,
            node("a1", 200, held_stages=((8, 32),)),
            "FAIL pp disk: a1 lacks layers 16-31 + head: needs 275.0 MB of disk to receive it, "
            "has 200.0 MB free (short by 75.0 MB)",
            "pp disk: a1 lacks layers 16-31 + head: needs 275.0 MB of disk to receive it, "
            "has 200.0 MB free (short by 75.0 MB)",
            id="pp-holds-another-share",
        ),
        pytest.param(
            PP,
            node("a1", 280),
            "PASS pp disk: coord holds layers 0-15; a1 receives layers 16-31 + head: "
            "needs 275.0 MB, has 280.0 MB free",
            None,
            id="pp-fits",
        ),
    ],
)
def test_explicit_choice_refuses_a_short_disk(
    choice: Parallelism, agent: NodeResources, check: str, refusal: str | None
) -> None:
    result = plan(choice, COORD, agent)
    lines = result.describe()
    assert check in lines
    assert result.refusal == refusal
    assert result.decision.chosen is choice


def test_auto_leaves_out_the_node_short_on_disk() -> None:
    # Three ranks cannot split 16 heads: auto picks pp, whose last stage lacks the disk;
    # without it, two nodes run tp and the other agent receives its tp share.
    result = plan(AUTO, COORD, node("a1", 1000), node("a2", 10))
    assert result.refusal is None
    assert result.decision.chosen is TP
    assert result.ranks == ("coord", "a1")
    assert result.decision.reason.startswith(
        "auto without a2 (too little disk to receive the model); "
    )
    lines = result.describe()
    assert (
        "PASS tp disk: coord holds the model; a1 receives its tp share (rank 1 of 2): "
        "needs 275.0 MB, has 1000.0 MB free" in lines
    )
    assert (
        "FAIL pp disk: a2 lacks layers 22-31 + head: needs 269.0 MB of disk to receive it, "
        "has 10.0 MB free (short by 259.0 MB)" in lines
    )


def test_auto_falls_back_to_single_when_every_agent_is_short() -> None:
    result = plan(AUTO, COORD, node("a1", 10))
    assert result.refusal is None and result.decision.chosen is SINGLE
    assert result.ranks == ("coord",)
    assert result.decision.reason.startswith("auto without a1 (too little disk")


def test_auto_refuses_with_the_numbers_when_the_rest_does_not_fit() -> None:
    # The coordinator alone has too little memory: without the agent nothing fits.
    small = replace(COORD, memory_bytes=40 * MB)
    result = plan(AUTO, small, node("a1", 10))
    assert result.refusal is not None
    assert result.refusal.startswith("model needs ")
    assert result.refusal.endswith(
        "; and tp disk: a1 lacks its tp share (rank 1 of 2): needs 275.0 MB of disk to "
        "receive it, has 10.0 MB free (short by 265.0 MB)"
    )


def test_without_transfer_or_for_single_there_is_no_disk_rule() -> None:
    for result in (
        plan(TP, COORD, node("a1", 1), transfer=None),
        plan(SINGLE, COORD, node("a1", 1)),
    ):
        assert not [check for check in result.checks if check.name.endswith(" disk")]
        assert result.refusal is None
