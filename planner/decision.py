"""The parallelism decision: operator choice and capabilities -> tp, pp or single, and why."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

MIN_CLUSTER_SIZE = 2

WORLD_SIZE_RULE = "world size"
GROUP_RULE = "distributed group"
VARIANT_RULE = "tensor-parallel variant"
ATTENTION_RULE = "attention heads"
KV_RULE = "KV heads"
MLP_RULE = "MLP size"
PIPELINE_RULE = "pipeline architecture"


class Parallelism(StrEnum):
    """How the model is split across the cluster; AUTO lets the planner choose."""

    AUTO = "auto"
    TP = "tp"
    PP = "pp"
    SINGLE = "single"

    @property
    def may_plan_tp(self) -> bool:
        """Whether tp can be planned under this choice, now or at a re-plan (which keeps it)."""
        return self in (Parallelism.AUTO, Parallelism.TP)

    @staticmethod
    def decide(inputs: DecisionInputs) -> Decision:
        """The Swift original's spelling; the one implementation is the module-level decide()."""
        return decide(inputs)


@dataclass(frozen=True, slots=True)
class DecisionInputs:
    """Everything the decision rules look at (memory is applied on top, in cluster_plan)."""

    operator_choice: Parallelism
    world_size: int
    attention_heads: int
    kv_heads: int
    has_tp_variant: bool
    distributed_group_available: bool
    intermediate_size: int = 0  # the MLP width every tp rank splits; 0 when unknown
    pipeline_problem: str = ""  # why the pipeline engine cannot split the model; "" if it can


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen strategy and why; failed_closed marks an explicit tp request that was refused."""

    chosen: Parallelism
    reason: str
    failed_closed: bool = False


@dataclass(frozen=True, slots=True)
class RuleCheck:
    """One rule the planner evaluated, whether it held, and the numbers behind it."""

    name: str
    passed: bool
    detail: str


def can_shard(heads: int, world_size: int) -> bool:
    """True when `heads` split into `world_size` equal, non-empty groups."""
    return heads > 0 and world_size > 0 and heads % world_size == 0


def _heads_check(name: str, heads: int, world_size: int) -> RuleCheck:
    if can_shard(heads, world_size):
        detail = f"{name} {heads} divide evenly across worldSize={world_size}"
        return RuleCheck(name, True, detail)
    detail = f"{name} {heads} do not divide evenly across worldSize={world_size}"
    return RuleCheck(name, False, detail)


def capability_checks(inputs: DecisionInputs) -> tuple[RuleCheck, ...]:
    """Every rule decide() consults, in the order it consults them, each with pass/fail."""
    size = inputs.world_size
    if size >= MIN_CLUSTER_SIZE:
        world = RuleCheck(WORLD_SIZE_RULE, True, f"worldSize={size} (tp and pp need at least 2)")
    else:
        world = RuleCheck(WORLD_SIZE_RULE, False, f"no cluster peer: worldSize={size}")
    if inputs.distributed_group_available:
        group = RuleCheck(GROUP_RULE, True, "distributed group available")
    else:
        group = RuleCheck(GROUP_RULE, False, "distributed group unavailable")
    if inputs.has_tp_variant:
        variant = RuleCheck(VARIANT_RULE, True, "model has a tensor-parallel variant")
    else:
        variant = RuleCheck(VARIANT_RULE, False, "model has no tensor-parallel variant")
    checks = (
        world,
        group,
        variant,
        _heads_check(ATTENTION_RULE, inputs.attention_heads, size),
        _heads_check(KV_RULE, inputs.kv_heads, size),
    )
    if inputs.intermediate_size:  # the same rule the tp worker enforces before loading
        checks += (_heads_check(MLP_RULE, inputs.intermediate_size, size),)
    return (*checks, pipeline_check(inputs))


def pipeline_check(inputs: DecisionInputs) -> RuleCheck:
    """Whether the pipeline engine can split this model's architecture into stages."""
    if inputs.pipeline_problem:
        return RuleCheck(PIPELINE_RULE, False, inputs.pipeline_problem)
    return RuleCheck(PIPELINE_RULE, True, "the pipeline engine can split this architecture")


def tp_split_problems(
    attention_heads: int, kv_heads: int, intermediate_size: int, world_size: int
) -> list[str]:
    """What stops tp over `world_size` ranks (empty when the model splits evenly)."""
    sizes = ((ATTENTION_RULE, attention_heads), (KV_RULE, kv_heads), (MLP_RULE, intermediate_size))
    return [f"{count} {name}" for name, count in sizes if count and count % world_size]


def decide(inputs: DecisionInputs) -> Decision:
    """Apply the rules in order: no peer, explicit single, explicit pp or tp (each fails closed
    when its engine cannot run the model), auto (tp, else pp, else single)."""
    choice = Parallelism(inputs.operator_choice)  # also accepts the plain string "tp"
    world, *capabilities, pipeline = capability_checks(inputs)
    # Rule 1: without a peer there is nothing to split, whatever was asked.
    if not world.passed:
        reason = f"{world.detail}; running single (operator asked for {choice.value})"
        return Decision(Parallelism.SINGLE, reason)
    if choice is Parallelism.SINGLE:
        return Decision(Parallelism.SINGLE, "operator asked for single")
    if choice is Parallelism.PP:
        if not pipeline.passed:
            reason = f"operator asked for pp but {pipeline.detail}; failing closed to single"
            return Decision(Parallelism.SINGLE, reason, failed_closed=True)
        reason = f"operator asked for pp across worldSize={inputs.world_size}"
        return Decision(Parallelism.PP, reason)

    missing = [check.detail for check in capabilities if not check.passed]
    held = ", ".join(check.detail for check in capabilities)
    if choice is Parallelism.TP:
        if not missing:
            reason = f"operator asked for tp and every capability holds: {held}"
            return Decision(Parallelism.TP, reason)
        # A missing capability is a misconfiguration to surface, never a silent downgrade to pp.
        reason = f"operator asked for tp but {' and '.join(missing)}; failing closed to single"
        return Decision(Parallelism.SINGLE, reason, failed_closed=True)
    if not missing:
        return Decision(Parallelism.TP, f"auto -> tp: {held}")
    if not pipeline.passed:
        return Decision(Parallelism.SINGLE, f"auto -> single: {missing[0]}, and {pipeline.detail}")
    return Decision(Parallelism.PP, f"auto -> pp: {missing[0]}")
