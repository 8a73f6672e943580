"""Auto by measurement: every plan the decision rules allow, over every group of members that
keeps the coordinator, and the model alone on each member with the coordinator relaying
(planner/relay.py), predicted from measured speeds (planner/speed.py); the fastest serves.

The rules stay the floor: tp is a candidate only where its capabilities hold, and an explicit
--parallelism is planned exactly as asked (it only gains its prediction). Fastest means the
highest predicted decode speed of one stream, then of a full batch; a plan over more machines
must be predicted MORE_MACHINES_MARGIN faster than the best over fewer to be chosen
(LEAVING_SINGLE_MARGIN when that is single).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from itertools import combinations

from planner.cluster_plan import plan_cluster
from planner.decision import Decision, Parallelism
from planner.disk import TransferSizes
from planner.memory import DEFAULT_CONTEXT_TOKENS, DEFAULT_HEADROOM, ModelShape
from planner.plan_data import ClusterPlan, NodeResources
from planner.relay import is_relayed, relayed
from planner.speed import (
    ClusterSpeeds,
    Prediction,
    predict_pp,
    predict_relay,
    predict_single,
    predict_tp,
)

RUNNERS_UP_IN_REASON = 2
# How much faster a plan over more machines must be predicted than the best over fewer. Every
# machine added is one more that can fail or lag. The lab's "Measured planner" benchmark
# predicts plans over several machines more optimistically than single on the same machines
# (costs single does not pay), so leaving single takes 20%. Between two plans over several
# machines that bias mostly cancels, and what is left runs the other way: the pipeline stage
# on the coordinator is the furthest off, and a plan over more machines gives it fewer layers.
# With 10% here, three lab machines chose pp=2 twice (pp=3 predicted 4% faster, served 12-13%
# faster), so between such plans the margin only breaks a near-tie.
MORE_MACHINES_MARGIN = 0.03
LEAVING_SINGLE_MARGIN = 0.20  # ... when the best over fewer is single


def predict(plan: ClusterPlan, shape: ModelShape, speeds: ClusterSpeeds) -> Prediction | None:
    """The plan's predicted speed; None when it is refused or a node's speed is missing."""
    if plan.refusal is not None or not speeds.covers(plan.ranks):
        return None
    batch = plan.batch_capacity
    chosen = plan.decision.chosen
    if is_relayed(plan):
        return predict_relay(shape, speeds, plan.ranks[0], plan.ranks[1], batch)
    if chosen is Parallelism.SINGLE:
        return predict_single(shape, speeds.nodes[plan.ranks[0]], batch)
    if chosen is Parallelism.TP:
        return predict_tp(shape, speeds, plan.ranks, batch)
    stages = [(stage.node_id, len(stage.layers)) for stage in plan.stages]
    return predict_pp(shape, speeds, stages, batch)


def _groups(nodes: Sequence[NodeResources]) -> Iterator[tuple[NodeResources, ...]]:
    """The coordinator with every combination of the others, in their order."""
    coordinator, others = nodes[0], list(nodes[1:])
    for size in range(len(others) + 1):
        for group in combinations(others, size):
            yield (coordinator, *group)


def plan_measured(
    choice: Parallelism,
    shape: ModelShape,
    nodes: Sequence[NodeResources],
    speeds: ClusterSpeeds,
    collective: str | None = None,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    headroom: float = DEFAULT_HEADROOM,
    max_batch: int = 1,
    prefix_cache_bytes: int | None = 0,
    transfer: TransferSizes | None = None,
) -> ClusterPlan:
    """plan_cluster with measured speeds: under auto the fastest predicted candidate, else the
    plan asked for; either way with its prediction (and under auto every candidate's)."""

    def plan(strategy: Parallelism, group: Sequence[NodeResources]) -> ClusterPlan:
        return plan_cluster(
            strategy, shape, group, collective, context_tokens, headroom, max_batch,
            prefix_cache_bytes, transfer, speeds,
        )  # fmt: skip

    floor = plan(choice, nodes)
    if Parallelism(choice) is not Parallelism.AUTO or not speeds.covers(
        [node.node_id for node in nodes]
    ):
        prediction = predict(floor, shape, speeds)
        return floor if prediction is None else replace(floor, predictions=(prediction,))
    candidates: list[tuple[ClusterPlan, Prediction]] = []
    for group in _groups(nodes):
        strategies = (Parallelism.SINGLE,) if len(group) == 1 else (Parallelism.TP, Parallelism.PP)
        for strategy in strategies:
            candidate = plan(strategy, group)
            prediction = predict(candidate, shape, speeds)
            if candidate.decision.chosen is strategy and prediction is not None:
                candidates.append((candidate, prediction))
    for agent in nodes[1:]:  # the model alone on one agent, the coordinator relaying
        candidate = plan_relay(plan(Parallelism.SINGLE, [agent]), nodes[0], shape, headroom, speeds)
        if candidate.refusal is None and candidate.predictions:
            candidates.append((candidate, candidate.predictions[0]))
    if not candidates:
        return floor
    candidates.sort(key=lambda pair: (-pair[1].decode_tps, -pair[1].batch_tps))
    best, prediction = _pick(candidates)
    fastest = candidates[0][1]
    others = [other for _, other in candidates if other is not prediction]
    if prediction is fastest:
        runners_up = "; ".join(
            f"{other.label} on {len(other.nodes)} predicted {other.decode_tps:.1f} tok/s"
            for other in others[:RUNNERS_UP_IN_REASON]
        )
        reason = (
            f"auto -> {prediction.label}: fastest of {len(candidates)} measured candidates, "
            f"predicted {prediction.decode_tps:.1f} tok/s at 1 stream ({prediction.dominant})"
            + (f"; {runners_up}" if runners_up else "")
        )
    else:
        reason = (
            f"auto -> {prediction.label} on {len(prediction.nodes)}: predicted "
            f"{prediction.decode_tps:.1f} tok/s at 1 stream ({prediction.dominant}); "
            f"{fastest.label} on {len(fastest.nodes)} predicted {fastest.decode_tps:.1f}, less "
            f"than {margin(prediction):.0%} faster on more machines"
        )
    left_out = [node.node_id for node in nodes if node.node_id not in best.ranks]
    if left_out:
        reason += f"; sitting out: {', '.join(left_out)}"
    return replace(
        best,
        decision=Decision(Parallelism(prediction.strategy), reason),
        predictions=(prediction, *others),
    )


def plan_relay(
    alone: ClusterPlan,
    coordinator: NodeResources,
    shape: ModelShape,
    headroom: float,
    speeds: ClusterSpeeds | None = None,
) -> ClusterPlan:
    """`alone` (single over one agent) relayed by `coordinator` (planner/relay.py), with the
    relay's own prediction (the hops there and back included) when `speeds` cover both."""
    plan = relayed(alone, coordinator, shape, headroom)
    prediction = predict(plan, shape, speeds) if speeds is not None else None
    return replace(plan, predictions=(prediction,) if prediction is not None else ())


def margin(fewer: Prediction) -> float:
    """How much faster than `fewer` a plan over more machines must be predicted."""
    return LEAVING_SINGLE_MARGIN if fewer.strategy == "single" else MORE_MACHINES_MARGIN


def _pick(candidates: list[tuple[ClusterPlan, Prediction]]) -> tuple[ClusterPlan, Prediction]:
    """The fastest candidate on the fewest machines, unless one on more machines is predicted
    `margin` faster (`candidates` fastest first)."""
    by_size = sorted(candidates, key=lambda pair: len(pair[1].nodes))  # stable: fastest first
    best = by_size[0]
    for candidate in by_size[1:]:
        if candidate[1].decode_tps > best[1].decode_tps * (1 + margin(best[1])):
            best = candidate
    return best
