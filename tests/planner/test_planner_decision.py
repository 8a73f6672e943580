"""The decision table of the seed PR, row by row: chosen strategy, failed_closed, and reason."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner import (
    Decision,
    DecisionInputs,
    Parallelism,
    RuleCheck,
    can_shard,
    capability_checks,
    decide,
)
from planner.decision import tp_split_problems

AUTO, TP, PP, SINGLE = Parallelism.AUTO, Parallelism.TP, Parallelism.PP, Parallelism.SINGLE


def inputs(
    choice: Parallelism,
    world_size: int = 2,
    attention_heads: int = 32,
    kv_heads: int = 8,
    has_tp_variant: bool = True,
    group: bool = True,
) -> DecisionInputs:
    """A cluster where every capability holds, unless a keyword says otherwise."""
    return DecisionInputs(
        operator_choice=choice,
        world_size=world_size,
        attention_heads=attention_heads,
        kv_heads=kv_heads,
        has_tp_variant=has_tp_variant,
        distributed_group_available=group,
    )


# (inputs, chosen, failed_closed, words the reason must contain)
TABLE = [
    pytest.param(
        inputs(AUTO, world_size=1),
        SINGLE,
        False,
        ["no cluster peer", "worldSize=1"],
        id="auto-worldSize1-single",
    ),
    pytest.param(
        inputs(TP, world_size=1),
        SINGLE,
        False,
        ["no cluster peer", "worldSize=1", "tp"],
        id="tp-worldSize1-single-not-failed-closed",
    ),
    pytest.param(
        inputs(PP, world_size=1),
        SINGLE,
        False,
        ["no cluster peer", "worldSize=1"],
        id="pp-worldSize1-single",
    ),
    pytest.param(
        inputs(SINGLE, world_size=0),
        SINGLE,
        False,
        ["no cluster peer", "worldSize=0"],
        id="single-worldSize0-single",
    ),
    pytest.param(
        inputs(SINGLE), SINGLE, False, ["operator asked for single"], id="explicit-single"
    ),
    pytest.param(
        inputs(PP, has_tp_variant=False, group=False),
        PP,
        False,
        ["operator asked for pp", "worldSize=2"],
        id="explicit-pp-ignores-capabilities",
    ),
    pytest.param(
        inputs(TP, group=False),
        SINGLE,
        True,
        ["operator asked for tp", "distributed group unavailable", "failing closed to single"],
        id="tp-no-group-fails-closed",
    ),
    pytest.param(
        inputs(TP, has_tp_variant=False),
        SINGLE,
        True,
        ["operator asked for tp", "no tensor-parallel variant", "failing closed to single"],
        id="tp-no-variant-fails-closed",
    ),
    pytest.param(
        inputs(TP, attention_heads=33),
        SINGLE,
        True,
        ["attention heads 33 do not divide evenly across worldSize=2", "failing closed"],
        id="tp-attention-heads-indivisible-fails-closed",
    ),
    pytest.param(
        inputs(TP, world_size=4, kv_heads=2),
        SINGLE,
        True,
        ["KV heads 2 do not divide evenly across worldSize=4", "failing closed"],
        id="tp-kv-heads-indivisible-fails-closed",
    ),
    pytest.param(
        inputs(TP, attention_heads=33, group=False),
        SINGLE,
        True,
        ["distributed group unavailable", "attention heads 33"],
        id="tp-reason-names-every-missing-capability",
    ),
    pytest.param(
        inputs(TP),
        TP,
        False,
        ["operator asked for tp", "attention heads 32", "KV heads 8", "worldSize=2"],
        id="tp-all-ok",
    ),
    pytest.param(
        inputs(AUTO, group=False),
        PP,
        False,
        ["auto -> pp", "distributed group unavailable"],
        id="auto-no-group-pp",
    ),
    pytest.param(
        inputs(AUTO, has_tp_variant=False),
        PP,
        False,
        ["auto -> pp", "no tensor-parallel variant"],
        id="auto-no-variant-pp",
    ),
    pytest.param(
        inputs(AUTO, attention_heads=33),
        PP,
        False,
        ["auto -> pp", "attention heads 33 do not divide evenly across worldSize=2"],
        id="auto-attention-heads-indivisible-pp",
    ),
    pytest.param(
        inputs(AUTO, world_size=4, kv_heads=2),
        PP,
        False,
        ["auto -> pp", "KV heads 2 do not divide evenly across worldSize=4"],
        id="auto-kv-heads-indivisible-pp",
    ),
    pytest.param(
        inputs(AUTO),
        TP,
        False,
        ["auto -> tp", "distributed group available", "worldSize=2"],
        id="auto-all-ok-tp",
    ),
]


@pytest.mark.parametrize(("given", "chosen", "failed_closed", "words"), TABLE)
def test_decide_follows_the_table(
    given: DecisionInputs, chosen: Parallelism, failed_closed: bool, words: list[str]
) -> None:
    decision = decide(given)
    assert decision.chosen is chosen
    assert decision.failed_closed is failed_closed
    for word in words:
        assert word in decision.reason


@pytest.mark.parametrize("given", [row.values[0] for row in TABLE], ids=[r.id for r in TABLE])
def test_explicit_tp_never_downgrades_to_pp(given: DecisionInputs) -> None:
    if given.operator_choice is TP:
        assert decide(given).chosen is not PP


def test_auto_reports_the_first_failing_capability_only() -> None:
    decision = decide(inputs(AUTO, has_tp_variant=False, attention_heads=33, group=False))
    assert decision.reason == "auto -> pp: distributed group unavailable"


def test_enum_static_method_is_the_same_decision() -> None:
    given = inputs(AUTO, kv_heads=3)
    assert Parallelism.decide(given) == decide(given)
    assert Parallelism.decide(given) == Decision(
        PP, "auto -> pp: KV heads 3 do not divide evenly across worldSize=2"
    )


def test_plain_string_choice_is_accepted() -> None:
    assert decide(inputs("tp", group=False)).failed_closed is True  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("heads", "world_size", "expected"),
    [
        pytest.param(32, 2, True, id="32-over-2"),
        pytest.param(8, 8, True, id="8-over-8"),
        pytest.param(33, 2, False, id="33-over-2"),
        pytest.param(2, 4, False, id="fewer-heads-than-ranks"),
        pytest.param(0, 2, False, id="zero-heads"),
        pytest.param(-4, 2, False, id="negative-heads"),
        pytest.param(8, 0, False, id="zero-world"),
        pytest.param(8, -2, False, id="negative-world"),
    ],
)
def test_can_shard(heads: int, world_size: int, expected: bool) -> None:
    assert can_shard(heads, world_size) is expected


def test_capability_checks_list_every_rule_with_numbers() -> None:
    checks = capability_checks(inputs(AUTO, world_size=4, attention_heads=32, kv_heads=2))
    assert [check.name for check in checks] == [
        "world size",
        "distributed group",
        "tensor-parallel variant",
        "attention heads",
        "KV heads",
        "pipeline architecture",
    ]
    assert checks[3] == RuleCheck(
        "attention heads", True, "attention heads 32 divide evenly across worldSize=4"
    )
    assert checks[4] == RuleCheck(
        "KV heads", False, "KV heads 2 do not divide evenly across worldSize=4"
    )
    assert all("worldSize=4" in c.detail for c in checks if c.name in ("world size", "KV heads"))


def test_capability_checks_mark_a_lone_node() -> None:
    world = capability_checks(inputs(AUTO, world_size=1))[0]
    assert world == RuleCheck("world size", False, "no cluster peer: worldSize=1")


@pytest.mark.parametrize(
    ("choice", "intermediate", "expected"),
    [
        (Parallelism.AUTO, 1024, Parallelism.TP),
        (Parallelism.AUTO, 1000, Parallelism.TP),  # 1000 splits over 2
        (Parallelism.AUTO, 1001, Parallelism.PP),
        (Parallelism.TP, 1001, Parallelism.SINGLE),  # fails closed, as for heads
        (Parallelism.AUTO, 0, Parallelism.TP),  # unknown width: not checked
    ],
)
def test_the_mlp_width_must_split_like_the_heads(choice, intermediate, expected) -> None:
    given = replace(inputs(choice), intermediate_size=intermediate)
    decision = decide(given)
    assert decision.chosen is expected
    if intermediate % 2:
        assert f"MLP size {intermediate} do not divide evenly" in decision.reason


def test_tp_split_problems_is_the_workers_rule() -> None:
    assert tp_split_problems(8, 4, 1024, 2) == []
    assert tp_split_problems(3, 3, 1001, 2) == ["3 attention heads", "3 KV heads", "1001 MLP size"]


RECURRENT = "layer 0 keeps a MambaCache, not a KV cache"


@pytest.mark.parametrize(
    ("choice", "has_tp_variant", "chosen", "failed_closed", "reason"),
    [
        pytest.param(PP, True, SINGLE, True, "operator asked for pp but " + RECURRENT, id="pp"),
        pytest.param(AUTO, True, TP, False, "auto -> tp", id="auto-tp"),
        pytest.param(AUTO, False, SINGLE, False, "auto -> single: model has no", id="auto"),
        pytest.param(TP, True, TP, False, "operator asked for tp", id="tp"),
    ],
)
def test_a_model_the_pipeline_cannot_split(
    choice: Parallelism, has_tp_variant: bool, chosen: Parallelism, failed_closed: bool, reason: str
) -> None:
    decision_inputs = replace(
        inputs(choice, has_tp_variant=has_tp_variant), pipeline_problem=RECURRENT
    )
    decision = decide(decision_inputs)
    assert (decision.chosen, decision.failed_closed) == (chosen, failed_closed)
    assert decision.reason.startswith(reason)
    check = capability_checks(decision_inputs)[-1]
    assert check == RuleCheck("pipeline architecture", False, RECURRENT)
