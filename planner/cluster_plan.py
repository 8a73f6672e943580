"""Planning for the live cluster: the decision rules, then memory fit on every node."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from errors import PlanError
from planner.allocation import allocate_layers
from planner.decision import (
    GROUP_RULE,
    Decision,
    DecisionInputs,
    Parallelism,
    RuleCheck,
    capability_checks,
    decide,
)
from planner.disk import DiskNeed, TransferSizes, disk_check
from planner.memory import (
    DEFAULT_CONTEXT_TOKENS,
    DEFAULT_HEADROOM,
    ModelShape,
    NodeFit,
    bounded,
    format_bytes,
    format_pair,
    single_need,
    stage_need,
    tp_need_per_rank,
)
from planner.plan_data import ClusterPlan, NodeResources, StageAssignment
from planner.speed import ClusterSpeeds, split_by_speed

JACCL = "jaccl"
RING = "ring"
COLLECTIVES = (JACCL, RING)


PREFIX_CACHE_SHARE = 0.5  # of the memory left after weights and the batch's KV


def _validate(nodes: Sequence[NodeResources], collective: str | None) -> None:
    if not nodes:
        raise PlanError("cannot plan with no nodes: the coordinator itself must be listed")
    seen: set[str] = set()
    for node in nodes:
        if node.node_id in seen:
            raise PlanError(f"node id {node.node_id!r} appears twice; every node needs its own id")
        seen.add(node.node_id)
        if node.memory_bytes <= 0:
            raise PlanError(
                f"node {node.node_id} reports {node.memory_bytes} bytes of memory; must be > 0"
            )
    if collective is not None and collective not in COLLECTIVES:
        raise PlanError(f"unknown collective {collective!r}; expected one of {list(COLLECTIVES)}")


def _coverage(nodes: Sequence[NodeResources], backend: str) -> tuple[bool, str]:
    missing = [node.node_id for node in nodes if backend not in node.backends]
    have = len(nodes) - len(missing)
    detail = f"{backend} on {have}/{len(nodes)} nodes"
    if missing:
        detail += f" (missing on {', '.join(missing)})"
    return not missing, detail


def _choose_backend(
    nodes: Sequence[NodeResources], collective: str | None
) -> tuple[str | None, RuleCheck]:
    """JACCL everywhere is always usable; the TCP ring only when the operator accepted it."""
    jaccl_ok, jaccl_detail = _coverage(nodes, JACCL)
    if collective == RING:
        ring_ok, ring_detail = _coverage(nodes, RING)
        detail = f"{ring_detail}; {jaccl_detail}"
        if ring_ok:
            return RING, RuleCheck("collective backend", True, detail)
        return (JACCL if jaccl_ok else None), RuleCheck("collective backend", jaccl_ok, detail)
    if not jaccl_ok and collective is None:
        jaccl_detail += "; the ring backend is used only when accepted (collective=ring)"
    return (JACCL if jaccl_ok else None), RuleCheck("collective backend", jaccl_ok, jaccl_detail)


def _list_fits(fits: Sequence[NodeFit]) -> str:
    parts = []
    for fit in fits:
        short = fit.need_bytes - fit.available_bytes
        suffix = f" (short by {format_bytes(short)})" if short > 0 else ""
        parts.append(fit.describe() + suffix)
    return "; ".join(parts)


@dataclass(frozen=True, slots=True)
class _Sizing:
    """What every memory check needs, bundled so the three layouts share one signature."""

    shape: ModelShape
    nodes: tuple[NodeResources, ...]
    context_tokens: int  # KV tokens to hold: one context per sequence of a full batch
    headroom: float
    batch: int = 1  # sequences decoded together: a pipeline's micro-batches share them
    speeds: ClusterSpeeds | None = None  # measured: pipeline layers split by speed

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(node.node_id for node in self.nodes)


def _plan_pp(decision: Decision, checks: tuple[RuleCheck, ...], sizing: _Sizing) -> ClusterPlan:
    shape, nodes = sizing.shape, sizing.nodes
    if len(nodes) > shape.num_layers:
        detail = f"{len(nodes)} stages but the model has {shape.num_layers} layers"
        too_many = f"pp needs at least one layer per stage: {detail}; use fewer nodes"
        check = RuleCheck("pp memory", False, detail)
        return ClusterPlan(decision, (*checks, check), sizing.node_ids, (), (), too_many)
    ranges, split = _speed_split(sizing)
    if ranges is None:
        ranges, split = allocate_layers(shape.num_layers, [n.memory_bytes for n in nodes]), "memory"
    last = len(nodes) - 1
    stages = tuple(
        StageAssignment(
            node.node_id,
            layers,
            stage_need(
                shape, layers, index == 0, index == last, sizing.context_tokens, sizing.headroom
            ),
            node.memory_bytes,
        )
        for index, (node, layers) in enumerate(zip(nodes, ranges, strict=True))
    )
    bounds = {node.node_id: node.memory_bound for node in sizing.nodes}
    fits = tuple(
        NodeFit(s.node_id, s.need_bytes, s.available_bytes, bounds.get(s.node_id, ""))
        for s in stages
    )
    fit_all = all(fit.fits for fit in fits)
    check = RuleCheck("pp memory", fit_all, f"layers split by {split}: {_list_fits(fits)}")
    refusal = None if fit_all else f"pipeline stages do not fit: {_list_fits(fits)}"
    return ClusterPlan(decision, (*checks, check), sizing.node_ids, stages, fits, refusal)


def _speed_split(sizing: _Sizing) -> tuple[list[range] | None, str]:
    """Layer ranges that make the slowest stage fastest within every node's memory, when every
    node's speed was measured; (None, "") otherwise."""
    shape, nodes, speeds = sizing.shape, sizing.nodes, sizing.speeds
    if speeds is None or not speeds.covers(sizing.node_ids):
        return None, ""
    last = len(nodes) - 1
    capacities = []
    for index, node in enumerate(nodes):
        fitting = [
            count
            for count in range(1, shape.num_layers + 1)
            if stage_need(
                shape, range(count), index == 0, index == last, sizing.context_tokens,
                sizing.headroom,
            ) <= node.memory_bytes
        ]  # fmt: skip
        capacities.append(max(fitting, default=0))
    rows = sizing.batch / min(len(nodes), sizing.batch)
    costs = [speeds.nodes[node.node_id].layer.at(rows) for node in nodes]
    head = speeds.nodes[nodes[-1].node_id].head.at(rows)
    counts = split_by_speed(shape.num_layers, costs, capacities, head)
    if counts is None:
        return None, ""
    starts = [sum(counts[:index]) for index in range(len(counts))]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)], (
        "measured speed within memory"
    )


def _plan_tp(
    choice: Parallelism,
    decision: Decision,
    checks: tuple[RuleCheck, ...],
    sizing: _Sizing,
    backend: str | None,
) -> ClusterPlan:
    nodes = sizing.nodes
    need = tp_need_per_rank(sizing.shape, len(nodes), sizing.context_tokens, sizing.headroom)
    fits = tuple(NodeFit(n.node_id, need, n.memory_bytes, n.memory_bound) for n in nodes)
    smallest = min(nodes, key=lambda node: node.memory_bytes)
    need_text, has_text = format_pair(need, smallest.memory_bytes)
    shares = f"equal tp shards need {need_text} per node"
    has = f"{smallest.node_id} has {has_text}{bounded(smallest.memory_bound)}"
    if all(fit.fits for fit in fits):
        check = RuleCheck("tp memory", True, f"{shares}; smallest node {has}")
        return ClusterPlan(decision, (*checks, check), sizing.node_ids, (), fits, None, backend)
    shortfall = f"{shares} but {has}"
    checks = (*checks, RuleCheck("tp memory", False, shortfall))
    if choice is not Parallelism.AUTO:
        refusal = f"tp does not fit: {shortfall} (per node: {_list_fits(fits)})"
        return ClusterPlan(decision, checks, sizing.node_ids, (), fits, refusal, backend)
    if shape_problem := sizing.shape.pipeline_problem:
        refusal = f"tp does not fit: {shortfall}, and pp cannot run the model: {shape_problem}"
        return ClusterPlan(decision, checks, sizing.node_ids, (), fits, refusal, backend)
    # Heterogeneous-cluster fallback: a proportional pipeline may fit where equal shards cannot.
    reason = f"auto -> pp: {shortfall}; layers split in proportion to memory"
    plan = _plan_pp(Decision(Parallelism.PP, reason), checks, sizing)
    if plan.refusal is None:
        return plan
    return replace(plan, refusal=f"nothing fits: {shortfall}, and {plan.refusal}")


def _plan_single(decision: Decision, checks: tuple[RuleCheck, ...], sizing: _Sizing) -> ClusterPlan:
    coordinator = sizing.nodes[0]
    need = single_need(sizing.shape, sizing.context_tokens, sizing.headroom)
    fit = NodeFit(coordinator.node_id, need, coordinator.memory_bytes, coordinator.memory_bound)
    check = RuleCheck("single memory", fit.fits, fit.describe())
    refusal = None
    if not fit.fits:
        need_text, has_text = format_pair(need, coordinator.memory_bytes)
        short = format_bytes(need - coordinator.memory_bytes)
        refusal = (
            f"model needs {need_text} but {coordinator.node_id} has {has_text}"
            f"{bounded(coordinator.memory_bound)} (short by {short})"
        )
    return ClusterPlan(decision, (*checks, check), (coordinator.node_id,), (), (fit,), refusal)


def plan_cluster(
    choice: Parallelism,
    shape: ModelShape,
    nodes: Sequence[NodeResources],
    collective: str | None = None,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    headroom: float = DEFAULT_HEADROOM,
    max_batch: int = 1,
    prefix_cache_bytes: int | None = 0,
    transfer: TransferSizes | None = None,
    speeds: ClusterSpeeds | None = None,
) -> ClusterPlan:
    """Decide the strategy for these nodes (rank order) and check it fits every node's memory.

    Every node must hold its weights plus the KV cache of a full batch: `max_batch`
    sequences of `context_tokens` each, plus its share of the prefix cache. The prefix
    cache is `prefix_cache_bytes` of whole-model KV, or with None, PREFIX_CACHE_SHARE of
    the memory the tightest node has left. With `transfer` (weights are sent to nodes
    that lack them), a node that lacks its part must also have the disk to receive it:
    auto leaves such a node out and plans the rest, an explicit choice is refused. A plan
    that does not fit comes back with `refusal` set; PlanError means invalid input. With
    `speeds` (every node measured), a pipeline's layers are split by speed within memory.
    planner/batch.py plans a smaller batch when this one does not fit.
    """
    plan = _plan_memory(
        choice, shape, nodes, collective, context_tokens, headroom, max_batch, prefix_cache_bytes,
        speeds,
    )  # fmt: skip

    def without(left_out: set[str]) -> ClusterPlan:
        """The same planning over the nodes but those auto leaves out."""
        rest = [node for node in nodes if node.node_id not in left_out]
        return plan_cluster(
            choice, shape, rest, collective, context_tokens, headroom, max_batch,
            prefix_cache_bytes, transfer, speeds,
        )  # fmt: skip

    if sitter := _member_to_sit_out(choice, plan, nodes):
        fit = next(fit for fit in plan.fits if fit.node_id == sitter)
        need_text, has_text = format_pair(fit.need_bytes, fit.available_bytes)
        rest = without({sitter})
        if rest.refusal is not None:
            return plan  # the whole cluster's refusal names every node's numbers
        left_out = (
            f"auto without {sitter} (its share needs {need_text}, it has {has_text}"
            f"{bounded(fit.bound)})"
        )
        reason = f"{left_out}; {rest.decision.reason}"
        return replace(rest, decision=replace(rest.decision, reason=reason))
    if transfer is None or plan.refusal is not None or plan.decision.chosen is Parallelism.SINGLE:
        return plan
    check = disk_check(f"{plan.decision.chosen.value} disk", _disk_needs(plan, nodes, transfer))
    plan = replace(plan, checks=(*plan.checks, check))
    if check.passed:
        return plan
    short = {need.node_id for need in _disk_needs(plan, nodes, transfer) if not need.fits}
    if Parallelism(choice) is not Parallelism.AUTO or nodes[0].node_id in short:
        return replace(plan, refusal=f"{check.name}: {check.detail}")
    rest = without(short)
    left_out = f"auto without {', '.join(sorted(short))} (too little disk to receive the model)"
    refusal = None if rest.refusal is None else f"{rest.refusal}; and {check.name}: {check.detail}"
    return replace(
        rest,
        decision=replace(rest.decision, reason=f"{left_out}; {rest.decision.reason}"),
        checks=(*rest.checks, check),
        refusal=refusal,
    )


def _member_to_sit_out(
    choice: Parallelism, plan: ClusterPlan, nodes: Sequence[NodeResources]
) -> str | None:
    """Under auto, the member whose share does not fit and who has the least memory: the
    rest may serve without it. The coordinator (nodes[0]) never sits out; explicit choices
    are refused as planned."""
    if Parallelism(choice) is not Parallelism.AUTO or plan.refusal is None or len(nodes) < 2:
        return None
    memory = {node.node_id: node.memory_bytes for node in nodes[1:]}
    short = [fit.node_id for fit in plan.fits if not fit.fits and fit.node_id in memory]
    return min(short, key=memory.__getitem__, default=None)


def _disk_needs(
    plan: ClusterPlan, nodes: Sequence[NodeResources], transfer: TransferSizes
) -> list[DiskNeed]:
    """What each node of a tp or pp plan receives: a tp rank its share (its slices of what
    Model.shard splits, the rest whole), a pp stage its layers, unless it holds the model
    (or, for a stage, its share) already."""
    by_id = {node.node_id: node for node in nodes}
    if not plan.stages:
        world, needs = len(plan.ranks), []
        for rank, node_id in enumerate(plan.ranks):
            node = by_id[node_id]
            if node.holds_model:
                needs.append(DiskNeed(node_id, "the model", 0, node.disk_free_bytes))
                continue
            what = f"its tp share (rank {rank} of {world})"
            size = 0 if (rank, world) in node.held_ranks else transfer.rank_bytes(world)
            needs.append(DiskNeed(node_id, what, size, node.disk_free_bytes))
        return needs
    needs = []
    last = len(plan.stages) - 1
    for index, stage in enumerate(plan.stages):
        node, layers = by_id[stage.node_id], stage.layers
        what = f"layers {layers.start}-{layers.stop - 1}" + (" + head" if index == last else "")
        held = node.holds_model or (layers.start, layers.stop) in node.held_stages
        size = 0 if held else transfer.stage_bytes(layers, index == 0, index == last)
        needs.append(DiskNeed(node.node_id, what, size, node.disk_free_bytes))
    return needs


def _plan_memory(
    choice: Parallelism,
    shape: ModelShape,
    nodes: Sequence[NodeResources],
    collective: str | None,
    context_tokens: int,
    headroom: float,
    max_batch: int,
    prefix_cache_bytes: int | None,
    speeds: ClusterSpeeds | None = None,
) -> ClusterPlan:
    if prefix_cache_bytes is None:
        plan = _plan_memory(
            choice, shape, nodes, collective, context_tokens, headroom, max_batch, 0, speeds
        )
        prefix_cache_bytes = _spare_prefix_cache_bytes(plan, shape) if plan.refusal is None else 0
    if prefix_cache_bytes < 0:
        raise PlanError(f"prefix_cache_bytes={prefix_cache_bytes} must not be negative")
    cached_tokens = prefix_cache_bytes // shape.prefix_kv_bytes_per_token
    _validate(nodes, collective)
    if max_batch < 1:
        raise PlanError(f"max_batch={max_batch} must be at least 1")
    choice = Parallelism(choice)
    backend, backend_check = _choose_backend(nodes, collective)
    inputs = DecisionInputs(
        operator_choice=choice,
        world_size=len(nodes),
        attention_heads=shape.attention_heads,
        kv_heads=shape.kv_heads,
        intermediate_size=shape.intermediate_size,
        has_tp_variant=shape.has_tp_variant,
        distributed_group_available=backend is not None,
        pipeline_problem=shape.pipeline_problem,
    )
    decision = decide(inputs)
    checks: list[RuleCheck] = []
    for check in capability_checks(inputs):
        checks.append(check)
        if check.name == GROUP_RULE:
            checks.append(backend_check)  # right after the rule it explains
    sizing = _Sizing(
        shape, tuple(nodes), _kv_tokens(shape, context_tokens, max_batch, cached_tokens),
        headroom, max_batch, speeds,
    )  # fmt: skip
    if decision.chosen is Parallelism.TP:
        plan = _plan_tp(choice, decision, tuple(checks), sizing, backend)
    elif decision.chosen is Parallelism.PP:
        plan = _plan_pp(decision, tuple(checks), sizing)
    else:
        plan = _plan_single(decision, tuple(checks), sizing)
    return replace(
        plan,
        batch_capacity=max_batch,
        max_batch=max_batch,
        context_tokens=context_tokens,
        prefix_cache_bytes=cached_tokens * shape.prefix_kv_bytes_per_token,
        kv_bits=shape.kv_bits,
        kv_bytes_per_token=_kv_bytes_per_token(shape),
        quantized_kv_start=shape.quantized_kv_start if shape.kv_bits else 0,
        full_kv_bytes_per_token=shape.full_kv_bytes_per_token_per_layer * shape.num_layers,
    )


def _kv_tokens(shape: ModelShape, context_tokens: int, batch: int, cached_tokens: int) -> int:
    """The KV every node's need counts, in tokens of the cache's size per token: `batch`
    sequences of `context_tokens`, full precision under quantized_kv_start, and the prefix
    cache's tokens (all of it plain tokens when nothing is quantized)."""
    per_layer = batch * shape.sequence_kv_bytes_per_layer(context_tokens)
    per_layer += cached_tokens * shape.prefix_kv_bytes_per_token // shape.num_layers
    return math.ceil(per_layer / shape.kv_bytes_per_token_per_layer)


def _kv_bytes_per_token(shape: ModelShape) -> int:
    """KV bytes of one token over every layer (all ranks or stages together)."""
    return shape.kv_bytes_per_token_per_layer * shape.num_layers


def _spare_prefix_cache_bytes(plan: ClusterPlan, shape: ModelShape) -> int:
    """PREFIX_CACHE_SHARE of what the tightest node has left, in whole-model KV bytes.

    A node holds a fraction of each cached token's KV (its layers, or its tp shard), so
    its spare bytes buy spare / fraction bytes of whole-model cache; the tightest node
    bounds everyone.
    """
    fractions = _kv_fractions(plan, shape)
    spare = [
        max(fit.available_bytes - fit.need_bytes, 0) / fraction
        for fit, fraction in zip(plan.fits, fractions, strict=True)
    ]
    return int(min(spare, default=0) * PREFIX_CACHE_SHARE)


def _kv_fractions(plan: ClusterPlan, shape: ModelShape) -> list[float]:
    if plan.stages:
        return [len(stage.layers) / shape.num_layers for stage in plan.stages]
    return [1 / len(plan.fits)] * len(plan.fits)
