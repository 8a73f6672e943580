"""Placing a set of models: the coordinator's memory shared, each agent serving one model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from itertools import combinations
from pathlib import Path

import pytest

from planner import (
    ModelShape,
    NodeResources,
    Parallelism,
    PlanError,
    plan_cluster,
    single_need,
    stage_need,
)
from planner import placement as placement_module
from planner.measured import plan_measured
from planner.memory import DEFAULT_HEADROOM
from planner.placement import ModelToPlace, Placement, PlanOne, place_models
from planner.relay import relayed
from planner.speed import ClusterSpeeds, Curve, LinkSpeed, NodeSpeed
from tests.helpers.planning import MB, SHAPE

AUTO, TP, PP, SINGLE = Parallelism.AUTO, Parallelism.TP, Parallelism.PP, Parallelism.SINGLE
ROOT = Path(__file__).resolve().parents[2]
MS = 1e-3
GIGABIT = 125e6  # bytes per second


def shape(layers: int, tp: bool = True) -> ModelShape:
    """SHAPE with `layers` of 1 MB (and its tied 2 MB embedding); no KV at context 0."""
    return replace(SHAPE, num_layers=layers, weight_bytes=(layers + 2) * MB, has_tp_variant=tp)


BIG, SMALL = shape(48, tp=False), shape(8)  # alone on one machine: 55.0 MB and 11.0 MB


def node(node_id: str, memory_mb: float) -> NodeResources:
    return NodeResources(node_id, "198.18.0.1", int(memory_mb * MB), ("ring",))


def planner(shapes: dict[str, ModelShape], prefix_cache: dict[str, int | None] | None = None):
    """Plans a model as serve would, with no KV (context 0) so the numbers stay round."""

    def plan(model: ModelToPlace, nodes: list[NodeResources], relay: bool = False):
        shape = shapes[model.model_id]
        if relay:  # as engines/cluster/planning.py's plan_nodes: single on the agent, relayed
            alone = plan(ModelToPlace(model.model_id, SINGLE), nodes[1:])
            return relayed(alone, nodes[0], shape, DEFAULT_HEADROOM)
        return plan_cluster(
            model.choice, shape, nodes, collective="ring", context_tokens=0,
            prefix_cache_bytes=(prefix_cache or {}).get(model.model_id, 0),
        )  # fmt: skip

    return plan


def place(shapes: dict[str, ModelShape], nodes: list[NodeResources], **choices) -> Placement:
    models = [ModelToPlace(model_id, choices.get(model_id, AUTO)) for model_id in shapes]
    return place_models(models, nodes, planner(shapes))


def agents_of(groups: dict[str, tuple[str, ...]]) -> list[set[str]]:
    return [set(group[1:]) for group in groups.values()]


# ---- where each model goes ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("shapes", "nodes", "choices", "groups", "strategies"),
    [
        pytest.param(
            {"a": SHAPE, "b": SMALL}, [node("c", 100)], {},
            {"a": ("c",), "b": ("c",)}, {"a": "single", "b": "single"},
            id="both-fit-on-the-coordinator-alone",
        ),
        pytest.param(
            {"a": SHAPE, "b": SMALL}, [node("c", 100), node("a1", 100)], {"a": SINGLE, "b": SINGLE},
            {"a": ("c", "a1"), "b": ("c",)}, {"a": "single", "b": "single"},
            id="single-by-choice-runs-the-bigger-one-alone-on-the-agent",
        ),
        pytest.param(
            {"a": SHAPE, "b": SMALL}, [node("c", 100), node("a1", 100)], {"a": PP, "b": SINGLE},
            {"a": ("c", "a1"), "b": ("c",)}, {"a": "pp=2", "b": "single"},
            id="pp-by-choice-is-never-relayed",
        ),
        pytest.param(
            {"big": BIG, "small": SMALL}, [node("c", 40), node("a1", 20), node("a2", 20)], {},
            {"big": ("c", "a1", "a2"), "small": ("c",)}, {"big": "pp=3", "small": "single"},
            id="the-big-one-takes-both-agents-the-small-one-stays-on-the-coordinator",
        ),
        pytest.param(
            {"a": SHAPE, "b": SHAPE}, [node("c", 60), node("a1", 60), node("a2", 60)], {},
            {"a": ("c", "a1"), "b": ("c", "a2")}, {"a": "tp=2", "b": "single"},
            id="from-the-tables-the-most-memory-left-on-the-tightest-machine",
        ),
    ],
)  # fmt: skip
def test_each_model_goes_where_the_rules_say(
    shapes: dict[str, ModelShape],
    nodes: list[NodeResources],
    choices: dict[str, Parallelism],
    groups: dict[str, tuple[str, ...]],
    strategies: dict[str, str],
) -> None:
    placement = place(shapes, nodes, **choices)
    assert placement.refusal is None
    assert placement.groups == groups
    assert {m: placement_module.label(p) for m, p in placement.plans.items()} == strategies


def test_an_explicit_strategy_is_honoured_before_memory_headroom() -> None:
    # pp asked for both: one agent each, though both single on the big coordinator would
    # leave more memory on the tightest machine (and the tables alone would choose that)
    nodes = [node("c", 1000), node("a1", 15), node("a2", 15)]
    placement = place({"a": SMALL, "b": SMALL}, nodes, a=PP, b=PP)
    assert placement.groups == {"a": ("c", "a1"), "b": ("c", "a2")}
    labels = [c.describe() for c in placement.candidates]
    assert labels[0] == "a pp=2 on c, a1; b pp=2 on c, a2"
    assert "a single on c; b single on c" in labels[1:]  # valid, and ranked after


def test_a_model_alone_on_an_agent_costs_the_coordinator_only_its_embedding() -> None:
    """A coordinator too small for any layer beside the embedding (a pipeline's first stage
    needs 2 MB + 1 MB, plus headroom): the model runs single on the agent, relayed."""
    placement = place({"a": SHAPE}, [node("c", 3), node("a1", 60)])
    assert placement.refusal is None
    plan = placement.plans["a"]
    assert placement_module.runs_on(plan) == "a1 (relayed by c)"
    assert [(s.node_id, s.layers) for s in plan.stages] == [("c", range(0, 0)), ("a1", range(32))]
    assert placement_module.need_on(plan, "c") == stage_need(SHAPE, range(0), True, False, 0)
    assert placement_module.need_on(plan, "a1") == single_need(SHAPE, 0)
    assert plan.checks[-1].name == "relay memory" and plan.checks[-1].passed
    assert plan.decision.reason.startswith("alone on a1, relayed by c: ")
    data = json.loads(json.dumps(placement.to_dict()))
    assert [(m["strategy"], m["nodes"], m["relayed"]) for m in data["models"]] == [
        ("single", ["c", "a1"], True)
    ]
    refused = place({"a": SHAPE}, [node("c", 2), node("a1", 60)])  # not even the embedding
    assert refused.refusal is not None and "relay on c needs 2.2 MB but it has 2.0 MB" in (
        refused.refusal
    )


def test_the_coordinator_is_counted_once_for_every_model() -> None:
    placement = place({"a": SHAPE, "b": SMALL}, [node("c", 100)])
    need_a, need_b = single_need(SHAPE, 0), single_need(SMALL, 0)
    assert placement.candidates[0].order == ("a", "b")
    assert placement.plans["a"].fits[0].available_bytes == 100 * MB
    assert placement.plans["b"].fits[0].available_bytes == 100 * MB - need_a  # sees less
    (memory,) = placement.memory_by_node()
    assert memory.needs == {"a": need_a, "b": need_b}
    assert memory.left_bytes == 100 * MB - need_a - need_b
    assert memory.describe() == "memory c: has 100.0 MB; needs a 37.4 MB, b 11.0 MB; 51.6 MB left"


def test_an_agent_is_never_given_to_two_models() -> None:
    nodes = [node("c", 200), node("a1", 100), node("a2", 100), node("a3", 100)]
    placement = place({"a": SHAPE, "b": SMALL, "c2": shape(16)}, nodes)
    assert len(placement.candidates) > 10
    for candidate in placement.candidates:
        for first, second in combinations(agents_of(candidate.groups), 2):
            assert not first & second, candidate.describe()
        assert all(group[0] == "c" for group in candidate.groups.values())


def test_order_matters_and_the_order_that_fits_is_found() -> None:
    """b (an automatic prefix cache) planned first takes half of what the coordinator has
    left for its cache, and a no longer fits; a first, b caches in what a leaves."""
    shapes = {"b": SMALL, "a": SHAPE}
    plan = planner(shapes, prefix_cache={"b": None})
    b_first = plan(ModelToPlace("b", AUTO), [node("c", 60)])
    left = node("c", 60).memory_bytes - b_first.fits[0].need_bytes
    assert left < single_need(SHAPE, 0)  # b first, then a: refused
    placement = place_models([ModelToPlace(m, AUTO) for m in shapes], [node("c", 60)], plan)
    assert placement.refusal is None
    assert [c.order for c in placement.candidates] == [("a", "b")]


# ---- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shapes", "nodes", "refusal"),
    [
        pytest.param(
            {"big": BIG, "small": SMALL}, [node("c", 40), node("a1", 20)],
            "cannot place the set on c 40.0 MB, a1 20.0 MB: big on c, a1 after small took "
            "11.0 MB of c: pipeline stages do not fit: c: needs 33.0 MB, has 29.0 MB (short by "
            "4.0 MB); a1: needs 24.2 MB, has 20.0 MB (short by 4.2 MB)",
            id="each-fits-alone-not-together",
        ),
        pytest.param(
            {"a": SHAPE, "big": BIG}, [node("c", 50)],
            "cannot place the set on c 50.0 MB: big on c: model needs 55.0 MB but c has "
            "50.0 MB (short by 5.0 MB)",
            id="one-fits-nowhere",
        ),
    ],
)  # fmt: skip
def test_a_set_that_cannot_fit_is_refused_with_the_numbers(
    shapes: dict[str, ModelShape], nodes: list[NodeResources], refusal: str
) -> None:
    placement = place(shapes, nodes)
    assert placement.refusal == refusal
    assert placement.plans == {} and placement.candidates == ()
    assert placement.describe()[-1] == f"refused: {refusal}"
    assert [memory.left_bytes for memory in placement.memory_by_node()] == [
        n.memory_bytes for n in nodes
    ]


@pytest.mark.parametrize(
    ("models", "nodes", "message"),
    [
        ([ModelToPlace("a", AUTO)] * 2, [node("c", 100)], "model 'a' is listed twice"),
        ([ModelToPlace("a", AUTO)], [], "cannot place models with no nodes"),
    ],
)
def test_invalid_input_is_a_plan_error(
    models: list[ModelToPlace], nodes: list[NodeResources], message: str
) -> None:
    with pytest.raises(PlanError, match=message):
        place_models(models, nodes, planner({"a": SHAPE}))


# ---- the greedy, past MAX_CANDIDATES ------------------------------------------------------


def test_past_the_bound_the_biggest_model_first_takes_what_auto_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(placement_module, "MAX_CANDIDATES", 1)
    nodes = [node("c", 100), node("a1", 20), node("a2", 20)]
    placement = place({"small": SMALL, "big": BIG}, nodes)
    assert placement.refusal is None
    assert placement.candidates[0].order == ("big", "small")
    assert placement.groups == {"small": ("c",), "big": ("c", "a1", "a2")}


# ---- with measured speeds -----------------------------------------------------------------


def speed(node_id: str, slowdown: float) -> NodeSpeed:
    """1 ms a layer at one row, 2 ms at 8; the head 2 ms and 4 ms; times `slowdown`."""
    return NodeSpeed(
        node_id,
        layer=Curve(((1, 1 * MS * slowdown), (8, 2 * MS * slowdown))),
        head=Curve(((1, 2 * MS * slowdown), (8, 4 * MS * slowdown))),
        prefill_layer_s=10 * MS * slowdown,
        prefill_chunk=256,
    )


def measured(shapes: dict[str, ModelShape], speeds: ClusterSpeeds) -> PlanOne:
    def plan(model: ModelToPlace, nodes: list[NodeResources], relay: bool = False):
        shape = shapes[model.model_id]
        if relay:
            alone = plan(ModelToPlace(model.model_id, SINGLE), nodes[1:])
            return relayed(alone, nodes[0], shape, DEFAULT_HEADROOM)
        return plan_measured(
            model.choice, shape, nodes, speeds, collective="ring", context_tokens=0, max_batch=8,
        )  # fmt: skip

    return plan


def test_with_measured_speeds_the_highest_predicted_total_wins() -> None:
    """A slow coordinator and one fast agent: the agent goes where the summed tok/s is highest,
    here to the short model alone, relayed (400 tok/s, the long one single 29.4), rather than
    to the long one (alone 117.6, the short one single 100), or to neither (100 + 29.4). Each
    model given the agent is planned by measurement, which prefers the relay to a pipeline
    over the slow coordinator (the short one's would be 348)."""
    speeds = ClusterSpeeds(
        {"c": speed("c", 4.0), "a1": speed("a1", 1.0)}, {"a1": LinkSpeed("a1", 50e-6, GIGABIT)}
    )
    shapes = {"short": SMALL, "long": SHAPE}
    models = [ModelToPlace(model_id, AUTO) for model_id in shapes]
    placement = place_models(models, [node("c", 500), node("a1", 500)], measured(shapes, speeds))
    totals = [candidate.predicted_tps for candidate in placement.candidates]
    assert None not in totals and totals == sorted(totals, reverse=True) and len(totals) > 1
    assert totals == pytest.approx([429.4, 217.6, 129.4], abs=0.05)
    assert placement.groups == {"short": ("c", "a1"), "long": ("c",)}
    assert placement.candidates[0].describe().startswith("short single on a1 (relayed by c);")
    chosen = sum(plan.predictions[0].batch_tps for plan in placement.plans.values())
    assert placement.candidates[0].predicted_tps == pytest.approx(chosen)


# ---- what it prints and sends -------------------------------------------------------------


def test_describe_and_to_dict_name_every_model_node_and_candidate() -> None:
    placement = place({"big": BIG, "small": SMALL}, [node("c", 40), node("a1", 20), node("a2", 20)])
    lines = placement.describe()
    assert lines[0] == "planned in order (the coordinator's memory is shared): small, big"
    assert lines[1].startswith("big: pp=3 on c, a1, a2 (auto -> pp: ")
    assert lines[2].startswith("small: single on c (")
    assert lines[3:6] == [
        "memory c: has 40.0 MB; needs big 24.2 MB, small 11.0 MB; 4.8 MB left",
        "memory a1: has 20.0 MB; needs big 15.4 MB; 4.6 MB left",
        "memory a2: has 20.0 MB; needs big 17.6 MB; 2.4 MB left",
    ]
    data = json.loads(json.dumps(placement.to_dict()))
    assert [(m["model_id"], m["strategy"], m["nodes"]) for m in data["models"]] == [
        ("big", "pp=3", ["c", "a1", "a2"]),
        ("small", "single", ["c"]),
    ]
    assert data["order"] == ["small", "big"] and data["refusal"] is None
    assert data["memory"][0]["left_bytes"] == 40 * MB - sum(data["memory"][0]["needs"].values())
    assert data["candidate_count"] == len(data["candidates"]) == len(placement.candidates)


# ---- tandem plan --model A --model B ------------------------------------------------------


def tandem_plan(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "plan", *flags, "--context-tokens", "256",
         "--max-batch", "1", "--prefix-cache-bytes", "0", "--cpu-float32", "off",
         "--state-dir", str(tmp_path / "state"), "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def test_tandem_plan_previews_placing_two_models_over_world_size_machines(
    tmp_path: Path,
) -> None:
    from tests.helpers.demo_models import make_demo_model

    big = make_demo_model(tmp_path, layers=8, hidden=512)  # 76 MB of float32 weights
    small = make_demo_model(tmp_path, layers=4)  # 11 MB
    models = ["--model", str(big), "--model", str(small)]
    result = tandem_plan(tmp_path, *models, "--world-size", "3", "--memory-limit", "64M")
    assert result.returncode == 0, result.stderr
    here, lines = f"{socket.gethostname()}-coordinator", result.stdout.splitlines()
    assert lines[:4] + lines[5:9] == [
        f"model: {big} (llama, 8 layers)",
        f"model: {small} (llama, 4 layers)",
        f"planned in order (the coordinator's memory is shared): {small}, {big}",
        f"{big}: pp=3 on {here}, machine-1, machine-2 (auto -> pp: attention heads 8 do not "
        "divide evenly across worldSize=3)",
        f"memory {here}: has 64.0 MB; needs {big} 23.1 MB, {small} 13.2 MB; 27.7 MB left",
        f"memory machine-1: has 64.0 MB; needs {big} 31.4 MB; 32.6 MB left",
        f"memory machine-2: has 64.0 MB; needs {big} 33.6 MB; 30.4 MB left",
        "candidates that fit: 7, the best first:",
    ]
    assert lines[4].startswith(f"{small}: single on {here} (")

    refused = tandem_plan(tmp_path, *models, "--world-size", "2", "--memory-limit", "48M")
    assert refused.returncode == 2, refused.stderr
    limited = "48.0 MB (--memory-limit)"
    assert refused.stdout.splitlines()[-1] == (
        f"refused: cannot place the set on {here} {limited}, machine-1 {limited}: {big} on "
        f"{here}, machine-1 after {small} took 13.2 MB of {here}: nothing fits: equal tp shards "
        f"need 46.2 MB per node but {here} has 34.8 MB (--memory-limit), and pipeline stages do "
        f"not fit: {here}: needs 33.6 MB, has 34.8 MB (--memory-limit); machine-1: needs 54.5 "
        f"MB, has {limited} (short by 6.5 MB)"
    )
