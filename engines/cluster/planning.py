"""What `serve` plans with: the operator's planning choices (PlanSettings) and the plan a
model gets over a list of nodes (plan_nodes), the same for serve, `tandem plan` and placing
several models."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from engines.model.info import ModelFacts
from engines.model.precision import on_cpu
from planner import ClusterPlan, NodeResources, Parallelism, TransferSizes, plan_cluster
from planner.batch import PlanAt, plan_batch
from planner.measured import plan_measured, plan_relay
from planner.memory import (
    DEFAULT_HEADROOM,
    DEFAULT_MAX_BATCH,
    DEFAULT_QUANTIZED_KV_START,
    ModelShape,
)
from planner.relay import may_relay
from planner.speed import ClusterSpeeds

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PlanSettings:
    """The operator's planning choices."""

    choice: Parallelism
    collective: str | None
    context_tokens: int
    queue_size: int
    max_batch: int = DEFAULT_MAX_BATCH
    rediscover_interval_s: float = 10.0  # 0 disables looking for agents that join later
    cpu_float32: bool = True  # upcast half-precision weights on the CPU when that fits
    prefix_cache_bytes: int | None = 0  # None: the planner derives it from the memory left
    # Measure every node's speed and link and let auto pick the fastest plan (speed_survey.py):
    # "auto" when a member is another machine, "on", or "off" (the decision rules alone).
    measure: str = "off"
    kv_bits: int = 0  # the KV cache's quantization (--kv-bits); 0: none
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START  # ... from this many tokens on
    # --max-batch left unset: a full batch that does not fit is planned as the largest batch
    # that does (planner/batch.py); given, it is planned as asked or refused.
    shrink_batch: bool = False


def plan_nodes(
    facts: ModelFacts,
    settings: PlanSettings,
    nodes: list[NodeResources],
    members: list[Any],
    weights: Any | None = None,
    speeds: ClusterSpeeds | None = None,
    relayed: bool = False,
) -> ClusterPlan:
    """The plan `serve` runs (and `tandem plan` prints) for `nodes`, the coordinator first.

    With `weights` (a WeightSource: agents may receive the model), what each member holds
    and the disk it needs to receive its part join the plan. On the CPU, half-precision
    weights are upcast to float32 when that plan fits; otherwise the model's own precision.
    With measured `speeds`, auto picks the fastest predicted plan (planner/measured.py).
    `relayed` (a placement's choice, for one agent beside the coordinator): the model runs
    single on that agent, the coordinator relaying (planner/relay.py); with any other nodes,
    or a --parallelism other than auto or single, it is planned as usual. A full batch is
    planned in either precision before a smaller one (planner/batch.py), which only
    `settings.shrink_batch` allows.
    """
    transfer = None
    if weights is not None and members:
        from engines.weights.holdings import with_holdings

        nodes = with_holdings(nodes, members, weights.content_hash)
        transfer = TransferSizes(facts.to_shape(), weights.model_bytes())

    relay = relayed and len(nodes) == 2 and may_relay(settings.choice)

    def plan(float32: bool, batch: int) -> ClusterPlan:
        shape = facts.to_shape(float32, settings.kv_bits, settings.quantized_kv_start)
        if relay:
            alone = plan_alone(Parallelism.SINGLE, shape, nodes[1:], batch)
            return plan_relay(alone, nodes[0], shape, DEFAULT_HEADROOM, speeds)
        return plan_alone(settings.choice, shape, nodes, batch)

    def plan_alone(
        choice: Parallelism, shape: ModelShape, nodes: list[NodeResources], batch: int
    ) -> ClusterPlan:
        if speeds is not None:
            return plan_measured(
                choice, shape, nodes, speeds, settings.collective,
                settings.context_tokens, max_batch=batch,
                prefix_cache_bytes=settings.prefix_cache_bytes, transfer=transfer,
            )  # fmt: skip
        return plan_cluster(
            choice,
            shape,
            nodes,
            collective=settings.collective,
            context_tokens=settings.context_tokens,
            max_batch=batch,
            prefix_cache_bytes=settings.prefix_cache_bytes,
            transfer=transfer,
        )

    def upcast(batch: int) -> ClusterPlan:
        return replace(plan(True, batch), compute_dtype="float32")

    ways: list[PlanAt] = [lambda batch: plan(False, batch)]
    upcasting = settings.cpu_float32 and facts.can_upcast and on_cpu()
    if upcasting:
        ways.insert(0, upcast)
    chosen = plan_batch(ways, settings.max_batch, settings.shrink_batch)
    if upcasting and chosen.compute_dtype != "float32":
        log.info("float32 does not fit: computing in the model's own half precision")
    return chosen
