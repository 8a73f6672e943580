"""Models loaded and unloaded while serving: `POST /v1/models`, `DELETE /v1/models/{id}`,
`--load-on-demand` (a request naming an unloaded model loads it) and `--keep-alive` (an idle
model is unloaded).

A model loaded at run time never moves one already served: it is planned over what they
leave, the coordinator's memory less their needs there and the members none of them uses,
with a full batch there or alone on an agent before a smaller batch (--max-batch unset,
planner/batch.py). When it does not fit even so, a load a request asked for first unloads
the least recently used idle model (no request running or queued) and tries again; a load
through `POST /v1/models` never evicts, it is refused with the planner's numbers. Unloading
closes the model's supervisor (its engine core exits, its agents are released), so its
memory returns on every machine it used. A machine that joins (or comes back) places the set
again (cli/set_rediscovery.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from engines.api.model_admin import ModelExists
from errors import EngineError, PlanError, TandemError
from planner import NodeResources, Parallelism

from .serve_config import ServeConfig
from .served_model import ModelChoice, ServedModel, placement_of
from .set_rediscovery import SetRediscovery

log = logging.getLogger(__name__)

UNLOADED, UNLOADING, FAILED = "unloaded", "unloading", "failed"
WAIT_POLL_S = 0.05
KEEP_ALIVE_POLL_S = 1.0


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
    """Every model this server knows: loaded, loading, or unloaded and loaded on demand."""

    def __init__(self, context: ServingContext, models: Any, served: list[ServedModel]) -> None:
        self.context = context
        self.models = models  # engines.core.service_registry.ServiceRegistry
        self._served = {model.service.model_id: model for model in served}
        self._lock = threading.RLock()  # one load or unload at a time
        self._closed = threading.Event()
        self._rediscovery: SetRediscovery | None = None

    # -- loading ---------------------------------------------------------------------------

    def load(
        self, reference: str, parallelism: str | None = None, model_id: str | None = None
    ) -> Any:
        """POST /v1/models: resolve, place and start loading `reference`; returns its Service
        ("starting" until its engine has loaded, "failed" with the reason if it does not).
        Raises ConfigError (a bad or repeated model) or PlanError (does not fit) at once."""
        choice = Parallelism(parallelism) if parallelism else self.context.config.parallelism
        with self._lock:
            model = self._open(ModelChoice(reference, model_id, first=False), choice)
            model_id = model.service.model_id
            if model_id in self._served:
                model.close()
                raise ModelExists(f"the model '{model_id}' is served already")
            self._place_or_close(model, evict=False)
            self._served[model_id] = model
            self.models.add(model.service)
        self._start_in_background(model)
        return model.service

    def start_known(self, model: ServedModel) -> None:
        """A --model with --load-on-demand: listed as unloaded until a request names it."""
        model.service.swap_runner(None, UNLOADED, "loads when a request names it")

    async def wait_loaded(self, model_id: str) -> Any:
        """ServiceRegistry.on_demand: the model's Service once it answers (claimed for the
        request), loading it first when it is unloaded (after --keep-alive has finished
        unloading it); EngineError when it fails, does not fit, or takes longer than the request
        timeout."""
        deadline = time.monotonic() + self.context.limits.request_timeout_s
        while True:
            model = self._served.get(model_id)
            if model is None:
                raise EngineError(f"the model '{model_id}' is not served any more")
            service = model.service
            if service.claim():
                return service
            if service.state == UNLOADED:
                await asyncio.to_thread(self._load_known, model_id)
                continue
            if service.state == FAILED:
                raise EngineError(f"'{model_id}' failed to load: {service.state_reason}")
            if time.monotonic() >= deadline:
                raise EngineError(f"'{model_id}' is still loading ({service.state_reason})")
            await asyncio.sleep(WAIT_POLL_S)

    def _load_known(self, model_id: str) -> ServedModel:
        """Replace an unloaded model's entry by a model being loaded (the first request to
        come does it; the others find it starting)."""
        with self._lock:
            known = self._served[model_id]
            if known.service.state != UNLOADED:
                return known
            model = self._open(known.choice, known.supervisor.plan_settings.choice)
            try:
                self._place_or_close(model, evict=True)
            except PlanError as error:
                raise EngineError(f"cannot load '{model_id}': {error}") from None
            self._served[model_id] = model
            self.models.replace(model.service)
        self._start_in_background(model)
        return model

    def _open(self, choice: ModelChoice, parallelism: Parallelism) -> ServedModel:
        context = self.context
        config = replace(context.config, parallelism=parallelism)
        model = ServedModel.open(config, choice, context.limits, context.coordinator)
        model.attach(config, context.membership, context.key, context.address, context.node_id)
        return model

    def _place_or_close(self, model: ServedModel, evict: bool) -> None:
        try:
            while True:
                try:
                    return self._place(model)
                except PlanError:
                    if not evict or not self._evict_one(but=model.service.model_id):
                        raise
        except TandemError:
            model.close()
            raise

    def _place(self, model: ServedModel) -> None:
        """Plan it over what the served models leave: the coordinator's share and the free
        agents, or, when that does not fit, alone on one free agent (planner/relay.py); both
        at a full batch first, then (--max-batch unset) at the largest batch that fits;
        PlanError with the numbers if it fits neither way."""
        from engines.cluster.planning import plan_nodes
        from planner.placement import less_taken, need_on

        coordinator = self.context.coordinator
        others = [
            m
            for m in self._served.values()
            if m.service.model_id != model.service.model_id and holds_memory(m)
        ]
        taken: set[str] = set()
        for served in others:
            supervisor = served.supervisor
            if supervisor.member_group is None:  # it stops adopting members: they are shared now
                supervisor.member_group = plan_members(supervisor.plan, coordinator.node_id)
            taken |= supervisor.member_group
        plans = [m.supervisor.plan for m in others if m.supervisor.plan is not None]
        share = less_taken(coordinator, sum(need_on(p, coordinator.node_id) for p in plans))
        membership = self.context.membership
        free = [
            node
            for node in (membership.to_resources() if membership is not None else [])
            if node.node_id not in taken
        ]
        members = membership.members() if membership is not None else []
        settings = model.supervisor.plan_settings
        # a full batch either way before a smaller one either way (planner/batch.py)
        fixed = replace(settings, shrink_batch=False)
        group, relayed = free, False
        for attempt in (fixed, settings) if settings.shrink_batch else (settings,):
            plan = plan_nodes(model.facts, attempt, [share, *free], members, model.weights)
            if plan.refusal is None:
                break
            agent = self._relay_agent(model, attempt, share, free, members)
            if agent is not None:
                group, relayed = [agent], True
                break
        else:
            raise PlanError(
                f"'{model.service.model_id}' does not fit beside the models served: {plan.refusal}"
            )
        model.supervisor.coordinator = lambda: share
        model.supervisor.member_group = frozenset(node.node_id for node in group)
        model.supervisor.relayed = relayed

    def _relay_agent(
        self,
        model: ServedModel,
        settings: Any,
        share: NodeResources,
        free: list[NodeResources],
        members: list[Any],
    ) -> NodeResources | None:
        """The free agent the model fits alone on, relayed (planner/relay.py), the roomiest
        first; None when it fits on none."""
        from engines.cluster.planning import plan_nodes
        from planner.relay import is_relayed

        for agent in sorted(free, key=lambda node: -node.memory_bytes):
            alone = plan_nodes(
                model.facts, settings, [share, agent], members, model.weights, relayed=True
            )
            if alone.refusal is None and is_relayed(alone):
                return agent
        return None

    def _evict_one(self, but: str) -> bool:
        """Unload the least recently used idle model (not `but`) to make room; False when
        none is idle."""
        idle = [
            m
            for m in self._served.values()
            if m.service.model_id != but and m.service.runner is not None and m.service.runner.idle
        ]
        if not idle:
            return False
        victim = min(idle, key=lambda m: m.service.last_used)
        log.info("unloading %s (idle the longest) to make room", victim.service.model_id)
        self._unload_to_known(victim.service.model_id, "unloaded to make room for another model")
        return True

    def _start_in_background(self, model: ServedModel) -> None:
        def start() -> None:
            try:
                model.supervisor.start()
            except TandemError as error:
                log.error("loading %s failed: %s", model.service.model_id, error)
                model.supervisor.close()
                model.service.swap_runner(None, FAILED, str(error))

        threading.Thread(target=start, name=f"load {model.service.model_id}", daemon=True).start()

    # -- unloading -------------------------------------------------------------------------

    def unload(self, model_id: str) -> bool:
        """DELETE /v1/models/{id}: stop serving `model_id`, free its memory everywhere, and
        forget it; False if it is not served."""
        with self._lock:
            model = self._served.pop(model_id, None)
            if model is None:
                return False
            model.service.swap_runner(model.service.runner, UNLOADING, "unloading")
        try:
            model.close()
        finally:
            self.models.remove(model_id)
        log.info("unloaded %s", model_id)
        return True

    def _unload_to_known(self, model_id: str, reason: str) -> None:
        """Free a model's memory but keep it listed, unloaded: a request loads it again."""
        with self._lock:
            model = self._served[model_id]
            model.close(UNLOADING, reason)
            model.service.swap_runner(None, UNLOADED, reason)

    def keep_alive(self, idle_s: float) -> None:
        """Unload every model idle for `idle_s` (nothing submitted or claimed since, nothing
        running or queued). The runner is taken from the service in one step with that check,
        so a request arriving meanwhile either keeps it or waits for the model to load again."""

        def watch() -> None:
            while not self._closed.wait(KEEP_ALIVE_POLL_S):
                for model in list(self._served.values()):
                    with self._lock:
                        if self._served.get(model.service.model_id) is not model:
                            continue  # unloaded or replaced meanwhile
                        reason = f"idle for {idle_s:g} s"
                        runner = model.service.retire_if_idle(idle_s, UNLOADING, reason)
                        if runner is None:
                            continue
                        log.info("unloading %s: %s (--keep-alive)", model.service.model_id, reason)
                        runner.close()
                        self._unload_to_known(model.service.model_id, reason)

        threading.Thread(target=watch, name="keep-alive", daemon=True).start()

    def watch_membership(self) -> None:
        """Place the models again when machines join or come back (every
        --rediscover-interval; never without a cluster or with 0)."""
        context = self.context
        interval_s = context.config.rediscover_interval_s
        if context.membership is None or interval_s <= 0:
            return
        self._rediscovery = SetRediscovery(
            self._holding_memory, self._lock, context.coordinator, context.membership, interval_s
        )
        self._rediscovery.start()

    def _holding_memory(self) -> list[ServedModel]:
        return [model for model in self._served.values() if holds_memory(model)]

    def placements(self) -> dict[str, Any]:
        """GET /v1/placements: every model known placed afresh over the machines there now
        (every candidate, each node's memory before and after, predicted speeds when
        measured), beside where each model runs now."""
        from planner.relay import is_relayed

        with self._lock:
            served = list(self._served.values())
        placement = placement_of(served, self.context.coordinator, self.context.membership)
        current = {
            model.service.model_id: {
                "state": model.service.state,
                "nodes": list(model.supervisor.plan.ranks if model.supervisor.plan else ()),
                "relayed": bool(model.supervisor.plan and is_relayed(model.supervisor.plan)),
            }
            for model in served
        }
        return {"current": current, "preview": placement.to_dict()}

    def supervisors(self) -> list[Any]:
        with self._lock:
            return [model.supervisor for model in self._served.values()]

    def close(self) -> None:
        self._closed.set()
        if self._rediscovery is not None:
            self._rediscovery.close()
        with self._lock:
            served, self._served = list(self._served.values()), {}
        for model in served:
            model.close()


def holds_memory(model: ServedModel) -> bool:
    """Loaded, or loading: its plan's memory is taken."""
    return model.service.state not in (UNLOADED, FAILED)


def plan_members(plan: Any, coordinator_id: str) -> frozenset[str]:
    """The members (not the coordinator) a plan runs on (its ranks: every node, pp too)."""
    return frozenset(plan.ranks if plan is not None else ()) - {coordinator_id}
