"""The pure planner: which parallelism to run, how layers split, and whether it fits."""

from errors import PlanError
from planner.allocation import allocate_layers
from planner.batch import plan_batch
from planner.cluster_plan import plan_cluster
from planner.decision import (
    Decision,
    DecisionInputs,
    Parallelism,
    RuleCheck,
    can_shard,
    capability_checks,
    decide,
)
from planner.disk import DISK_MARGIN_BYTES, TransferSizes
from planner.memory import (
    ModelShape,
    NodeFit,
    format_bytes,
    format_pair,
    single_need,
    stage_need,
    tp_need_per_rank,
)
from planner.plan_data import ClusterPlan, NodeResources, StageAssignment

__all__ = [
    "DISK_MARGIN_BYTES",
    "ClusterPlan",
    "Decision",
    "DecisionInputs",
    "ModelShape",
    "NodeFit",
    "NodeResources",
    "Parallelism",
    "PlanError",
    "RuleCheck",
    "StageAssignment",
    "TransferSizes",
    "allocate_layers",
    "can_shard",
    "capability_checks",
    "decide",
    "format_bytes",
    "format_pair",
    "plan_batch",
    "plan_cluster",
    "single_need",
    "stage_need",
    "tp_need_per_rank",
]
