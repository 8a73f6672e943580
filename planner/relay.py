"""A model alone on an agent: single on that machine, relayed by the coordinator.

The coordinator keeps every model's scheduler (its engine core), so a model that runs on an
agent alone still passes through it: the coordinator embeds each step's tokens and hands
them to the agent, which runs every layer and samples. That is a pipeline whose first stage
holds no layers (engines/pipeline/engine.py), planned here as what it is for the operator:
single on the agent. The coordinator's share is the embedding; the agent's is single's need.
"""

from __future__ import annotations

from dataclasses import replace

from planner.decision import Parallelism, RuleCheck
from planner.memory import ModelShape, NodeFit, format_pair, stage_need
from planner.plan_data import ClusterPlan, NodeResources, StageAssignment

RELAY_RULE = "relay memory"


def relayed(
    alone: ClusterPlan, coordinator: NodeResources, shape: ModelShape, headroom: float
) -> ClusterPlan:
    """`alone` (single, planned over the agent as its only node) run through `coordinator`."""
    agent_fit = alone.fits[0]
    need = stage_need(shape, range(0, 0), True, False, 0, headroom)  # the embedding alone
    relay_fit = NodeFit(
        coordinator.node_id, need, coordinator.memory_bytes, coordinator.memory_bound
    )
    need_text, has_text = format_pair(need, coordinator.memory_bytes)
    check = RuleCheck(
        RELAY_RULE,
        relay_fit.fits,
        f"{coordinator.node_id} embeds each step's tokens for {agent_fit.node_id}: "
        f"needs {need_text}, has {has_text}",
    )
    refusal = alone.refusal
    if refusal is None and not relay_fit.fits:
        refusal = f"the relay on {coordinator.node_id} needs {need_text} but it has {has_text}"
    reason = f"alone on {agent_fit.node_id}, relayed by {coordinator.node_id}: "
    stages = (
        StageAssignment(coordinator.node_id, range(0, 0), need, coordinator.memory_bytes),
        StageAssignment(
            agent_fit.node_id,
            range(shape.num_layers),
            agent_fit.need_bytes,
            agent_fit.available_bytes,
        ),
    )
    return replace(
        alone,
        decision=replace(alone.decision, reason=reason + alone.decision.reason),
        checks=(*alone.checks, check),
        ranks=(coordinator.node_id, agent_fit.node_id),
        stages=stages,
        fits=(relay_fit, agent_fit),
        refusal=refusal,
    )


def is_relayed(plan: ClusterPlan) -> bool:
    """Single on an agent through the coordinator (stage 0 without layers)."""
    return plan.decision.chosen is Parallelism.SINGLE and bool(plan.stages)


def may_relay(choice: Parallelism) -> bool:
    """Whether the operator's --parallelism lets a model run alone on an agent."""
    return choice in (Parallelism.AUTO, Parallelism.SINGLE)
