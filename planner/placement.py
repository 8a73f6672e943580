"""Placing a set of models over the cluster: which machines serve which model, and how each splits.

Rules (v1):
- The coordinator (nodes[0]) hosts a part of every model: it runs each model's engine core.
  Its memory is shared: a model planned after others sees it less what they need there, so
  every order of the models is tried (k! for k models).
- Every other machine (an agent) runs one worker: it serves one model or none. Every
  assignment of agents to models-or-none is tried ((k + 1) ** agents); a candidate (an order
  and an assignment) plans each model over [the coordinator's remaining memory, *its agents]
  and is valid when no plan is refused. Past MAX_CANDIDATES, a greedy stands in: the biggest
  model first (by its need alone on the coordinator) takes what it is planned to use of the
  free machines, and so on.
- A model given exactly one agent may also run alone there, relayed by the coordinator
  (planner/relay.py: the coordinator keeps only its embedding), when its --parallelism is
  auto or single: every such model is tried both ways. The greedy never relays.
- The best valid candidate: first, the fewest models served otherwise than their explicit
  --parallelism asks (pp asked, one machine given: served single), then the fewest whose
  batch was shrunk to fit (planner/batch.py: fewer sequences than --max-batch). Then, when
  every plan has measured speeds, the highest predicted total
  (each plan's batch tok/s summed; optimistic, the coordinator's compute is shared too). From
  the tables alone: the most memory left, as a share of what it has, on the tightest machine
  used: the furthest from running out, and like one model's auto, which spreads over every
  machine. Ties: fewer machines, then the first tried (the models' order, agents to the first).
- Nothing valid: the refusal of the failing candidate that fell least short (then planned the
  most models before its refusal), after every machine's memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import permutations, product
from typing import Any

from errors import PlanError
from planner.decision import Parallelism
from planner.memory import bounded, format_bytes
from planner.plan_data import ClusterPlan, NodeResources
from planner.relay import is_relayed, may_relay

MAX_CANDIDATES = 20_000  # (order, assignment) pairs tried one by one; past it, the greedy
CANDIDATES_SHOWN = 10  # in describe() and to_dict(); `candidates` keeps them all


@dataclass(frozen=True, slots=True)
class ModelToPlace:
    """One model of the set, and the operator's --parallelism for it."""

    model_id: str
    choice: Parallelism


# Plans one model over a node list (the coordinator first); True: relayed (planner/relay.py).
PlanOne = Callable[[ModelToPlace, list[NodeResources], bool], ClusterPlan]
Choose = Callable[[ModelToPlace, tuple[NodeResources, ...]], tuple[NodeResources, ...]]


def label(plan: ClusterPlan) -> str:
    """The plan's strategy as Prediction labels it: single, or with its machines, e.g. pp=3."""
    chosen = plan.decision.chosen
    return chosen.value if chosen is Parallelism.SINGLE else f"{chosen.value}={len(plan.ranks)}"


def runs_on(plan: ClusterPlan) -> str:
    """The machines a plan runs on, e.g. 'a, b', or 'b (relayed by a)' for a relay."""
    if is_relayed(plan):
        return f"{plan.ranks[1]} (relayed by {plan.ranks[0]})"
    return ", ".join(plan.ranks)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One way to place the set: every model's plan (in the models' order), and the order
    in which they were planned, i.e. took their share of the coordinator."""

    order: tuple[str, ...]
    plans: dict[str, ClusterPlan]

    @property
    def groups(self) -> dict[str, tuple[str, ...]]:
        return {model_id: plan.ranks for model_id, plan in self.plans.items()}

    @property
    def predicted_tps(self) -> float | None:
        """Every plan's predicted batch tok/s summed; None unless every plan was measured."""
        if not all(plan.predictions for plan in self.plans.values()):
            return None
        return sum(plan.predictions[0].batch_tps for plan in self.plans.values())

    @property
    def machines(self) -> int:
        return len({node_id for group in self.groups.values() for node_id in group})

    def describe(self) -> str:
        parts = [f"{m} {label(p)} on {runs_on(p)}" for m, p in self.plans.items()]
        tps = self.predicted_tps
        return "; ".join(parts) + ("" if tps is None else f" (predicted {tps:.1f} tok/s)")

    def to_dict(self) -> dict[str, Any]:
        tps = self.predicted_tps
        return {
            "order": list(self.order),
            "models": [
                {
                    "model_id": m,
                    "strategy": label(p),
                    "nodes": list(p.ranks),
                    "relayed": is_relayed(p),
                }
                for m, p in self.plans.items()
            ],
            "predicted_tps": None if tps is None else round(tps, 2),
        }


@dataclass(frozen=True, slots=True)
class NodeMemory:
    """One machine's memory under a placement: what it has, and what each model needs there."""

    node_id: str
    available_bytes: int
    needs: dict[str, int]  # model id -> bytes

    @property
    def left_bytes(self) -> int:
        return self.available_bytes - sum(self.needs.values())

    def describe(self) -> str:
        used = ", ".join(f"{m} {format_bytes(n)}" for m, n in self.needs.items()) or "nothing"
        has, left = format_bytes(self.available_bytes), format_bytes(self.left_bytes)
        return f"memory {self.node_id}: has {has}; needs {used}; {left} left"


def memory_by_node(
    nodes: Sequence[NodeResources], plans: dict[str, ClusterPlan]
) -> tuple[NodeMemory, ...]:
    """Each node's memory before (as discovered) and what each plan needs of it."""
    return tuple(
        NodeMemory(
            node.node_id,
            node.memory_bytes,
            {m: need for m, plan in plans.items() if (need := need_on(plan, node.node_id))},
        )
        for node in nodes
    )


@dataclass(frozen=True, slots=True)
class Placement:
    """Every model's plan, or a refusal; and every valid candidate, best first."""

    nodes: tuple[NodeResources, ...]
    plans: dict[str, ClusterPlan]  # model id -> its plan, in the models' order
    refusal: str | None = None
    candidates: tuple[Candidate, ...] = ()

    @property
    def groups(self) -> dict[str, tuple[str, ...]]:
        """Model id -> the node ids it runs on, the coordinator first."""
        return {model_id: plan.ranks for model_id, plan in self.plans.items()}

    def memory_by_node(self) -> tuple[NodeMemory, ...]:
        return memory_by_node(self.nodes, self.plans)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (GET /v1/placements); the first CANDIDATES_SHOWN candidates."""
        return {
            "models": [
                {
                    "model_id": m,
                    "strategy": label(p),
                    "nodes": list(p.ranks),
                    "relayed": is_relayed(p),
                    "plan": p.to_dict(),
                }
                for m, p in self.plans.items()
            ],
            "order": list(self.candidates[0].order) if self.candidates else [],
            "memory": [
                {
                    "node_id": memory.node_id,
                    "available_bytes": memory.available_bytes,
                    "needs": memory.needs,
                    "left_bytes": memory.left_bytes,
                }
                for memory in self.memory_by_node()
            ],
            "refusal": self.refusal,
            "candidate_count": len(self.candidates),
            "candidates": [c.to_dict() for c in self.candidates[:CANDIDATES_SHOWN]],
        }

    def describe(self) -> list[str]:
        """Lines for `tandem plan`: each model's strategy and why, each machine's memory."""
        lines = []
        if self.candidates:
            order = ", ".join(self.candidates[0].order)
            lines.append(f"planned in order (the coordinator's memory is shared): {order}")
        for model_id, plan in self.plans.items():
            lines.append(f"{model_id}: {label(plan)} on {runs_on(plan)} ({plan.decision.reason})")
            if plan.predictions:
                lines.append(f"{model_id} predicted: {plan.predictions[0].describe()}")
        lines += [memory.describe() for memory in self.memory_by_node()]
        if len(self.candidates) > 1:
            lines.append(f"candidates that fit: {len(self.candidates)}, the best first:")
            lines += [f"  {c.describe()}" for c in self.candidates[:CANDIDATES_SHOWN]]
        if self.refusal is not None:
            lines.append(f"refused: {self.refusal}")
        return lines


@dataclass(frozen=True, slots=True)
class _Trial:
    """One (order, assignment) planned in turn, up to the first refused model, if any."""

    order: tuple[str, ...]
    plans: dict[str, ClusterPlan]  # in planning order; a refused plan is the last
    refused: str | None  # the model whose plan was refused


def place_models(
    models: Sequence[ModelToPlace], nodes: Sequence[NodeResources], plan: PlanOne
) -> Placement:
    """Place `models` over `nodes` (the coordinator first), `plan` planning one model over a
    node list (the coordinator first) as serve would. PlanError when the input is invalid."""
    ids = [model.model_id for model in models]
    if duplicates := sorted({m for m in ids if ids.count(m) > 1}):
        raise PlanError(f"model {duplicates[0]!r} is listed twice; place each model once")
    if not nodes:
        raise PlanError("cannot place models with no nodes: the coordinator itself must be listed")
    coordinator, agents = nodes[0], tuple(nodes[1:])
    if not models:
        return Placement(tuple(nodes), {})
    cache: dict[tuple[str, int, tuple[str, ...], bool], ClusterPlan] = {}

    def plan_over(
        model: ModelToPlace, taken: int, group: tuple[NodeResources, ...], relay: bool = False
    ) -> ClusterPlan:
        """`model` over the coordinator less `taken` bytes, and `group`; planned once."""
        key = (model.model_id, taken, tuple(node.node_id for node in group), relay)
        if key not in cache:
            cache[key] = plan(model, [less_taken(coordinator, taken), *group], relay)
        return cache[key]

    def attempt(
        order: Sequence[ModelToPlace], choose: Choose, relays: frozenset[str] = frozenset()
    ) -> _Trial:
        """Plan `order` in turn, each model over the agents `choose` gives it of the free ones
        (those in `relays` alone on theirs)."""
        ids_in_order = tuple(model.model_id for model in order)
        taken, free, plans = 0, agents, {}
        for model in order:
            group, relay = choose(model, free), model.model_id in relays
            plans[model.model_id] = planned = plan_over(model, taken, group, relay)
            if planned.refusal is not None:
                return _Trial(ids_in_order, plans, model.model_id)
            taken += need_on(planned, coordinator.node_id)
            free = tuple(agent for agent in free if agent.node_id not in planned.ranks)
        return _Trial(ids_in_order, plans, None)

    # The bound counts assignments; the relayed variants of one (a model with one agent, tried
    # both ways) come on top: planning is cached per model, share and group, so they are cheap.
    if math.factorial(len(models)) * (len(models) + 1) ** len(agents) > MAX_CANDIDATES:
        size = {m.model_id: need_on(plan_over(m, 0, ()), coordinator.node_id) for m in models}
        biggest_first = sorted(models, key=lambda model: -size[model.model_id])
        trials = [attempt(biggest_first, lambda model, free: free)]
    else:
        agent_ids = [agent.node_id for agent in agents]
        trials = [
            attempt(order, _assigned(dict(zip(agent_ids, owners, strict=True))), relays)
            for order in permutations(models)
            for owners in product([*ids, None], repeat=len(agents))
            for relays in _relay_choices(models, owners)
        ]
    valid = [
        Candidate(trial.order, {m: trial.plans[m] for m in ids})
        for trial in trials
        if trial.refused is None
    ]
    if not valid:
        return Placement(tuple(nodes), {}, _refusal(trials, nodes))
    ranked = _rank(valid, nodes, {model.model_id: model.choice for model in models})
    return Placement(tuple(nodes), ranked[0].plans, None, ranked)


def _relay_choices(
    models: Sequence[ModelToPlace], owners: tuple[str | None, ...]
) -> list[frozenset[str]]:
    """Every set of models to relay: any of those given exactly one agent whose
    --parallelism lets them run alone on it."""
    eligible = [m.model_id for m in models if owners.count(m.model_id) == 1 and may_relay(m.choice)]
    return [
        frozenset(m for m, relay in zip(eligible, flags, strict=True) if relay)
        for flags in product((False, True), repeat=len(eligible))
    ]


def _assigned(owners: dict[str, str | None]) -> Choose:
    """The free agents `owners` (agent id -> model id or None) gives each model."""
    return lambda model, free: tuple(a for a in free if owners[a.node_id] == model.model_id)


def _rank(
    valid: list[Candidate], nodes: Sequence[NodeResources], choices: dict[str, Parallelism]
) -> tuple[Candidate, ...]:
    """Best first (the module's rules); one candidate per set of groups and strategies."""
    measured = all(candidate.predicted_tps is not None for candidate in valid)

    def key(indexed: tuple[int, Candidate]) -> tuple[float, ...]:
        index, candidate = indexed
        # a model served otherwise than its explicit --parallelism asks is a last resort
        closed = sum(
            choices[model_id] is not Parallelism.AUTO and plan.decision.chosen != choices[model_id]
            for model_id, plan in candidate.plans.items()
        )
        # a full batch wherever one fits: fewer sequences at once is a last resort too
        shrunk = sum(plan.batch_capacity < plan.max_batch for plan in candidate.plans.values())
        if measured:
            tps = -(candidate.predicted_tps or 0.0)
            return (closed, shrunk, tps, candidate.machines, index)
        used = [memory for memory in memory_by_node(nodes, candidate.plans) if memory.needs]
        tightest = min(memory.left_bytes / memory.available_bytes for memory in used)
        return (closed, shrunk, -tightest, candidate.machines, index)

    ranked: dict[tuple[tuple[str, str, tuple[str, ...]], ...], Candidate] = {}
    for _, candidate in sorted(enumerate(valid), key=key):
        signature = tuple((m, runs_on(p), label(p)) for m, p in candidate.plans.items())
        ranked.setdefault(signature, candidate)
    return tuple(ranked.values())


def _refusal(trials: list[_Trial], nodes: Sequence[NodeResources]) -> str:
    """The refusal of the trial that fell least short, then planned the most models."""

    def key(trial: _Trial) -> tuple[int, int]:
        refused = trial.plans[trial.refused or ""]
        short = sum(max(fit.need_bytes - fit.available_bytes, 0) for fit in refused.fits)
        return (short, -len(trial.plans))

    worst = min(trials, key=key)
    model_id = worst.refused or ""
    refused, coordinator_id = worst.plans[model_id], nodes[0].node_id
    before = [m for m in worst.plans if m != model_id]
    taken = sum(need_on(worst.plans[m], coordinator_id) for m in before)
    after = f" after {', '.join(before)} took {format_bytes(taken)} of {coordinator_id}"
    machines = ", ".join(
        f"{node.node_id} {format_bytes(node.memory_bytes)}{bounded(node.memory_bound)}"
        for node in nodes
    )
    return (
        f"cannot place the set on {machines}: {model_id} on {', '.join(refused.ranks)}"
        f"{after if before else ''}: {refused.refusal}"
    )


def need_on(plan: ClusterPlan, node_id: str) -> int:
    """Bytes `plan` needs on `node_id` (0 when it does not run there)."""
    return sum(fit.need_bytes for fit in plan.fits if fit.node_id == node_id)


def less_taken(node: NodeResources, taken_bytes: int) -> NodeResources:
    """`node` as the next model sees it once others took `taken_bytes` of its memory; at
    least a byte, so that a node taken whole is refused with the numbers."""
    return replace(node, memory_bytes=max(node.memory_bytes - taken_bytes, 1))
