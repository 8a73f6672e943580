"""Models loaded and unloaded while serving (`POST /v1/models`, `DELETE /v1/models/{id}`).

A model loaded at run time never moves one already served: it is planned over what they
leave, the coordinator's memory less their needs there and the members none of them uses,
and refused with the planner's numbers when it does not fit there. Unloading closes its
supervisor (its engine core exits and its agents are released), so its memory returns on
every machine it used.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from typing import Any

from engines.api.model_admin import ModelExists
from planner import NodeResources, Parallelism
from planner.errors import PlanError, TandemError

from .serve_config import ServeConfig
from .served_model import ModelChoice, ServedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServingContext:
    """What every model of this server is attached with."""

    config: ServeConfig
    limits: Any  # engines.core.service.ServiceLimits
    coordinator: NodeResources
    membership: Any
    key: bytes | None
    address: str
    node_id: str


class ModelManager:
    def __init__(self, context: ServingContext, models: Any, served: list[ServedModel]) -> None:
        self.context = context
        self.models = models  # engines.core.served_models.ServedModels
        self._served = {model.service.model_id: model for model in served}
        self._lock = threading.Lock()  # one load or unload at a time

    def load(
        self, reference: str, parallelism: str | None = None, model_id: str | None = None
    ) -> Any:
        """Resolve, place and start loading `reference`; returns its Service (state
        "starting" until its engine has loaded, "failed" with the reason if it does not).
        Raises ConfigError (bad or repeated model) or PlanError (does not fit) at once."""
        context = self.context
        choice = Parallelism(parallelism) if parallelism else context.config.parallelism
        config = replace(context.config, parallelism=choice)
        with self._lock:
            model = ServedModel.open(
                config, ModelChoice(reference, model_id, first=False), context.limits,
                context.coordinator,
            )  # fmt: skip
            model_id = model.service.model_id
            if model_id in self._served or self.models.get(model_id) is not None:
                raise ModelExists(f"the model '{model_id}' is served already")
            model.attach(config, context.membership, context.key, context.address, context.node_id)
            try:
                self._place(model)
            except TandemError:
                model.close()
                raise
            self._served[model_id] = model
            self.models.add(model.service)
        threading.Thread(target=self._start, args=(model,), name=f"load {model_id}").start()
        return model.service

    def _place(self, model: ServedModel) -> None:
        """Plan it over what the served models leave; PlanError with the numbers if it
        does not fit there."""
        from engines.cluster.supervisor import plan_nodes

        coordinator = self.context.coordinator
        taken: set[str] = set()
        for served in self._served.values():
            supervisor = served.supervisor
            if supervisor.member_group is None:  # it stops adopting members: they are shared now
                supervisor.member_group = plan_members(supervisor.plan, coordinator.node_id)
            taken |= supervisor.member_group
        needs = sum(
            coordinator_need(m.supervisor.plan, coordinator.node_id) for m in self._served.values()
        )
        share = replace(coordinator, memory_bytes=max(1, coordinator.memory_bytes - needs))
        membership = self.context.membership
        free = [
            node
            for node in (membership.to_resources() if membership is not None else [])
            if node.node_id not in taken
        ]
        members = membership.members() if membership is not None else []
        settings = model.supervisor.plan_settings
        plan = plan_nodes(model.facts, settings, [share, *free], members, model.weights)
        if plan.refusal is not None:
            raise PlanError(
                f"'{model.service.model_id}' does not fit beside the models served: {plan.refusal}"
            )
        model.supervisor.coordinator = lambda: share
        model.supervisor.member_group = frozenset(node.node_id for node in free)

    def _start(self, model: ServedModel) -> None:
        try:
            model.supervisor.start()
        except TandemError as error:
            log.error("loading %s failed: %s", model.service.model_id, error)
            model.service.swap_runner(None, "failed", str(error))
            model.supervisor.close()

    def unload(self, model_id: str) -> bool:
        """Stop serving `model_id` and free its memory everywhere; False if it is not served."""
        with self._lock:
            model = self._served.pop(model_id, None)
            if model is None:
                return False
            model.service.swap_runner(model.service.runner, "unloading", "unloading")
        try:
            model.close()
        finally:
            self.models.remove(model_id)
        log.info("unloaded %s", model_id)
        return True

    def supervisors(self) -> list[Any]:
        with self._lock:
            return [model.supervisor for model in self._served.values()]

    def close(self) -> None:
        with self._lock:
            served, self._served = list(self._served.values()), {}
        for model in served:
            model.close()


def plan_members(plan: Any, coordinator_id: str) -> frozenset[str]:
    """The members (not the coordinator) a plan runs on."""
    if plan is None:
        return frozenset()
    nodes = {*plan.ranks, *(stage.node_id for stage in plan.stages)}
    return frozenset(nodes - {coordinator_id})


def coordinator_need(plan: Any, coordinator_id: str) -> int:
    """What a plan needs of the coordinator's memory (0 before it has a plan)."""
    if plan is None:
        return 0
    return next((fit.need_bytes for fit in plan.fits if fit.node_id == coordinator_id), 0)
