"""ClusterSupervisor: plan the live cluster, run the chosen engine, re-plan when a member dies."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from discovery.capabilities import PORT_ACTIVE
from engines.cluster.cluster_status import engine_status, members_status, resources_status
from engines.cluster.exclusions import MemberExclusions
from engines.cluster.group_move import GroupMove
from engines.cluster.launch import LaunchSettings, build_engine
from engines.cluster.planning import PlanSettings, plan_nodes
from engines.cluster.replan_history import ReplanHistory
from engines.cluster.speed_survey import SpeedSurvey, wants_measuring
from engines.core.core_process import THREAD_CORE, CoreProcess
from engines.core.engine import Engine
from engines.core.engine_spec import EngineSpec
from engines.core.memory_release import release_freed_memory
from engines.core.runner import EngineCore, EngineRunner
from engines.core.service import Service
from engines.model.info import ModelFacts
from engines.observability.process_memory import process_memory
from engines.observability.served_speed import ServedSpeed, one_stream_segments_ms
from errors import EngineError, PlanError, TandemError
from planner import ClusterPlan, NodeResources, Parallelism
from planner.relay import is_relayed
from planner.speed import ClusterSpeeds, Prediction, predict_speculating

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5
REDISCOVER_BROWSE_S = 1.0
RETRY_FIRST_S = 2.0  # between failed re-plan attempts, doubling up to RETRY_MAX_S
RETRY_MAX_S = 60.0
RELEASE_WAIT_S = 5.0
WATCHER_JOIN_S = 30.0


class ClusterSupervisor:
    """Owns the current plan and engine; swaps them into the Service after every (re-)plan.

    A lost member (membership callback) or an unhealthy engine (watch thread) triggers a
    re-plan on the watch thread: in-flight requests end with an error, queued ones are
    failed, every worker is released, and the survivors are planned and served again. A
    member whose worker keeps failing is left out of plans for a growing back-off.
    """

    def __init__(
        self,
        service: Service,
        facts: ModelFacts,
        plan_settings: PlanSettings,
        launch_settings: LaunchSettings,
        coordinator: Callable[[], NodeResources],
        membership: Any | None = None,
        engine_factory: Callable[[ClusterPlan], Engine | EngineSpec] | None = None,
        member_group: frozenset[str] | None = None,
    ) -> None:
        self.service = service
        # The members this model may use when several models share the cluster (their
        # placement, planner/placement.py); None: every member, and those that join later.
        self.member_group = member_group
        # Placed alone on the one member of its group, relayed by the coordinator
        # (planner/relay.py); planned as usual once that member is gone.
        self.relayed = False
        self.facts = facts
        self.plan_settings = plan_settings
        self.launch_settings = launch_settings
        self.coordinator = coordinator
        self.membership = membership
        self.survey: SpeedSurvey | None = None  # set by whoever opens the membership
        self.served_speed = ServedSpeed()  # beside the plan's prediction in /v1/cluster
        service.request_listeners.append(self.served_speed.observe)
        self.plan: ClusterPlan | None = None
        self.replans = 0
        self.last_replan_reason = ""
        self._templated_tokenizer: Any = None  # --chat-template's, loaded at the first launch
        self.replan_history = ReplanHistory()
        self._engine_factory = engine_factory or self._build_engine
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._replan_wanted = threading.Event()
        self._loss_count = 0  # bumped by every re-plan request, so none is lost mid-launch
        self._retired: list[EngineRunner] = []  # swapped out, closed by the next re-plan
        self._planned_nodes: set[str] = set()  # who could take part when the plan was made
        self._last_candidates: set[str] = set()  # ... by the last make_plan()
        self._move: GroupMove | None = None  # another group, adopted by the next re-plan
        self.exclusions = MemberExclusions()
        self._discovering = threading.Lock()  # one zeroconf browse at a time
        self._watcher = threading.Thread(target=self._watch, name="supervisor", daemon=True)

    # -- planning ----------------------------------------------------------------------------

    def make_plan(self) -> ClusterPlan:
        """Plan over the coordinator plus every verified, connected, not excluded member."""
        nodes = self._candidates()
        self._last_candidates = {node.node_id for node in nodes}  # for the launch that follows
        members = self.membership.members() if self.membership is not None else []
        weights = self.launch_settings.weights if self.launch_settings is not None else None
        speeds = self._speeds(nodes)
        return plan_nodes(
            self.facts, self.plan_settings, nodes, members, weights, speeds, self.relayed
        )

    def _speeds(self, nodes: list[NodeResources]) -> ClusterSpeeds | None:
        """The measured speeds of `nodes` (measuring those not measured yet), when wanted."""
        if self.survey is None or not wants_measuring(self.plan_settings.measure, nodes):
            return None
        settings = self.plan_settings
        return self.survey.for_plan(
            self.facts, nodes, settings.max_batch, settings.choice.may_plan_tp
        )

    def _candidates(self) -> list[NodeResources]:
        nodes = [self.coordinator()]
        if self.membership is not None:
            excluded = self.exclusions.excluded_now()
            nodes += [
                node
                for node in self.membership.to_resources()
                if node.node_id not in excluded and self._may_use(node.node_id)
            ]
        return nodes

    def _may_use(self, node_id: str) -> bool:
        return self.member_group is None or node_id in self.member_group

    def start(self) -> ClusterPlan:
        """First plan and engine; raises PlanError (refusal) or EngineError (launch failed)."""
        plan = self.make_plan()
        if plan.refusal:
            raise PlanError(plan.refusal)
        self._launch(plan)
        self._watcher.start()
        return plan

    def _build_engine(self, plan: ClusterPlan) -> EngineSpec:
        settings = self.launch_settings
        addresses = {self.coordinator().node_id: settings.coordinator_address}
        if self.membership is not None:
            members = self.membership.members()
            addresses |= {m.node_id: m.address for m in members}
            devices = {m.node_id: active_rdma(m.hello) for m in members if m.hello is not None}
            settings = replace(settings, rdma_devices={**settings.rdma_devices, **devices})
        return build_engine(plan, settings, self.membership, addresses)

    def _launch(self, plan: ClusterPlan) -> None:
        """Start the plan's engine and install it; a launch that fails or outlives close()
        leaves nothing behind (the runner closes the engine once its load returns)."""
        self.plan = plan
        # who could take part when the plan was made (not now: one may have joined since)
        self._planned_nodes = self._last_candidates
        decision = plan.decision
        log.info("plan: %s — %s", decision.chosen.value, decision.reason)
        for line in plan.describe():
            log.info("  %s", line)
        runner: EngineRunner | None = None
        try:
            # the batch the plan holds: --max-batch, or fewer when that many do not fit
            runner = EngineRunner(
                self._core_for(self._engine_factory(plan), plan.batch_capacity),
                self.plan_settings.queue_size,
                plan.batch_capacity,
            )
            runner.start(load_timeout_s=self.launch_settings.ready_timeout_s)
            tokenizer = self._api_tokenizer(runner)
        except TandemError:
            if runner is not None:
                runner.close()  # aborts a load still waiting on remote workers
            self._release_workers("launch failed")
            raise
        with self._lock:
            if not self._closed.is_set():
                self.service.tokenizer = tokenizer
                self.served_speed.reset()
                self.service.swap_runner(runner, "ok", decision.reason)
                runner = None
        if runner is not None:  # closed while launching: nobody may serve from it
            runner.close()
            self._release_workers("coordinator shutting down")

    def _api_tokenizer(self, runner: EngineRunner) -> Any:
        """The tokenizer the API renders prompts with: the engine's, or with --chat-template
        the model's loaded with that template in place of its own."""
        from engines.model.tokenizer_loading import load_serving_tokenizer

        template = self.launch_settings.chat_template
        if template is None:
            return runner.core.tokenizer
        if self._templated_tokenizer is None:  # once: every re-plan serves the same model
            try:
                path = self.launch_settings.model_path
                self._templated_tokenizer = load_serving_tokenizer(path, template)
            except (OSError, ValueError) as error:
                reason = f"cannot load the tokenizer with --chat-template: {error}"
                raise EngineError(reason) from error
        return self._templated_tokenizer

    def _core_for(self, made: Engine | EngineSpec, max_batch: int) -> Engine | EngineCore:
        """The engine core for what the factory made, scheduling up to `max_batch` sequences:
        a spec runs in a process of its own (`--engine-core process`, the default) or on a
        thread here; an engine object (a test's) runs on a thread here."""
        if not isinstance(made, EngineSpec):
            return made
        settings = self.launch_settings
        if settings.engine_core == THREAD_CORE:
            return made.build()
        return CoreProcess(made, max_batch, settings.core_lost_after_s)

    # -- failure handling --------------------------------------------------------------------

    def on_member_lost(self, node_id: str, reason: str) -> None:
        """Membership callback (background thread): re-plan if the member was in the plan."""
        self._replan_for(node_id, f"lost: {reason}")

    def on_assignment_failed(self, node_id: str, assignment_id: str, reason: str) -> None:
        self.exclusions.record_failure(node_id, reason)
        self._replan_for(node_id, f"failed: {reason}")

    def _replan_for(self, node_id: str, what: str) -> None:
        """Re-plan when the member has a part in the plan, naming that part (the reason ends
        every running request, so the client learns which node and rank or stage failed)."""
        plan = self.plan
        if plan is None:
            return
        part = describe_part(plan, node_id)
        if part is not None:
            self.request_replan(f"{part} {what}")

    def request_replan(self, reason: str) -> None:
        """Take the engine out of service now; the watch thread plans again."""
        with self._lock:
            if self._closed.is_set():
                return
            self.last_replan_reason = reason
            self.replan_history.record(reason)
            self._loss_count += 1
            runner = self.service.runner
            self.service.swap_runner(None, "degraded", reason)
            if runner is not None:
                self._retired.append(runner)
            self._replan_wanted.set()
        log.warning("re-planning: %s", reason)
        if runner is not None:
            runner.engine.abort(reason)  # unblocks a step stuck on the dead member at once

    def request_move(self, move: GroupMove, reason: str) -> None:
        """Re-plan over another group of members (the set of models was placed again): the
        re-plan releases this model's workers, waits for every other model that moves to have
        released theirs, then plans over the new group."""
        with self._lock:
            closed = self._closed.is_set()
            if not closed:
                self._move = move
        if closed:
            move.cancel()
            return
        self.request_replan(reason)

    def _watch(self) -> None:
        next_discovery = time.monotonic() + self.plan_settings.rediscover_interval_s
        while not self._closed.wait(WATCH_INTERVAL_S):
            runner = self.service.runner
            if runner is not None and not runner.engine.healthy():
                self.request_replan(_unhealthy(runner.engine))
            if self._replan_wanted.is_set():
                with self._browsing():  # who joins meanwhile is verified meanwhile ...
                    self._replan()
                if self._discovery_due(0.0, self.service.runner):
                    self._adopt_new_members(browse=False)  # ... and planned in at once
            elif self._discovery_due(next_discovery, runner):
                next_discovery = time.monotonic() + self.plan_settings.rediscover_interval_s
                self._adopt_new_members()

    @contextmanager
    def _browsing(self) -> Iterator[None]:
        """Browse for new agents on a thread of its own while the block runs (a re-plan, which
        can outlast the rediscovery interval), so one that joins then is not left waiting for
        the round after it."""
        if not self._discovery_enabled():
            yield
            return
        done = threading.Event()

        def browse() -> None:
            while not done.is_set() and not self._closed.is_set():
                with self._discovering:
                    try:
                        self.membership.discover(REDISCOVER_BROWSE_S)
                    except TandemError as error:
                        log.debug("re-discovery during a re-plan failed: %s", error)

        thread = threading.Thread(target=browse, name="browse during re-plan", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()

    def _discovery_due(self, due_at: float, runner: EngineRunner | None) -> bool:
        # Only while idle: adopting a member re-plans, which would cut a running request.
        idle = runner is not None and runner.idle
        return self._discovery_enabled() and idle and time.monotonic() >= due_at

    def _discovery_enabled(self) -> bool:
        # A model placed beside others keeps its group: a machine that joins later waits for
        # the next placement rather than go to whichever model looks first.
        return (
            self.membership is not None
            and self.plan_settings.rediscover_interval_s > 0
            and self.member_group is None
        )

    def _adopt_new_members(self, browse: bool = True) -> None:
        """Agents that joined after start-up: re-plan when they change the plan.

        Only a change in who could take part counts. The members' memory readings move on
        their own (a node that loaded its share has less free), so re-planning the same nodes
        would move layer boundaries and cut the service for nothing; memory that runs low is
        the pressure tiers' job (cluster/pressure.py)."""
        try:
            if browse:
                with self._discovering:  # not beside a browse still running from a re-plan
                    self.membership.discover(REDISCOVER_BROWSE_S)
            if {node.node_id for node in self._candidates()} == self._planned_nodes:
                return
            plan = self.make_plan()
        except TandemError as error:
            log.debug("re-discovery failed: %s", error)
            return
        if plan.refusal is None and _assignment(plan) != _assignment(self.plan):
            members = 1 + len(self.membership.to_resources())
            self.request_replan(f"membership changed: {members} verified node(s) now")

    def _replan(self) -> None:
        """Close what was retired, release every worker, then launch the survivors' plan,
        backing off between failed attempts; a loss reported during the launch re-plans again."""
        with self._lock:
            retired, self._retired = self._retired, []
        for runner in retired:
            runner.close()
        del retired
        release_freed_memory()  # what the old engine held, back to the OS
        self._release_workers(self.last_replan_reason)
        with self._lock:
            # Reports until now concern the workers just released (a killed worker's agent
            # reports it after the engine noticed): the plan made next sees who is left and
            # who is excluded. Re-planning for them again would cut the new engine for nothing.
            self._replan_wanted.clear()
            losses = self._loss_count
        self._adopt_move()
        delay_s = RETRY_FIRST_S
        while not self._closed.is_set():
            try:
                plan = self.make_plan()
                if plan.refusal:
                    raise PlanError(plan.refusal)
                self._launch(plan)
            except TandemError as error:
                log.error("re-plan failed: %s; retrying in %g s", error, delay_s)
                self.service.swap_runner(None, "degraded", f"re-plan failed: {error}")
                if self._closed.wait(delay_s):
                    return
                delay_s = min(delay_s * 2, RETRY_MAX_S)
                continue
            self.replans += 1
            self.replan_history.served(plan.decision.chosen.value)
            self.exclusions.record_success(plan)
            log.info("serving again after re-plan #%d as %s", self.replans, plan.decision.chosen)
            with self._lock:
                if self._loss_count != losses and not self._replan_wanted.is_set():
                    self._replan_wanted.set()  # a member was lost during the launch
            return

    def _adopt_move(self) -> None:
        """Take the group request_move() gave, once the others moving have left theirs."""
        move = self._move
        if move is None:
            return
        move.wait_for_the_others()
        with self._lock:
            self._move = None
        self.member_group, self.coordinator = move.group, move.coordinator
        self.relayed = move.relayed

    def _release_workers(self, reason: str) -> None:
        if self.membership is None:
            return
        # Wait for every agent to confirm its worker stopped: their ports are reused next.
        if self.member_group is None:
            released = self.membership.release_all(reason, wait_s=RELEASE_WAIT_S)
        else:  # only this model's: the other models' workers keep serving
            released = self.membership.release_nodes(
                sorted(self.member_group), reason, wait_s=RELEASE_WAIT_S
            )
        if not released:
            log.warning("not every agent confirmed the release within %g s", RELEASE_WAIT_S)

    # -- status and shutdown -----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The /v1/cluster body: decision, rules, assignment, members, model facts."""
        plan = self.plan
        runner = self.service.runner
        engine = engine_status(runner)
        body: dict[str, Any] = {
            "state": self.service.state,
            "state_reason": self.service.state_reason,
            "operator_choice": self.plan_settings.choice.value,
            "collective": self.plan_settings.collective,
            "replans": self.replans,
            "last_replan_reason": self.last_replan_reason,
            "replan_history": self.replan_history.describe(),
            "replans_by_reason": self.replan_history.counts(),
            "excluded": self.exclusions.describe(),
            "plan": plan.to_dict() if plan else None,
            "strategy": plan.decision.chosen.value if plan else None,
            "relayed": bool(plan and is_relayed(plan)),  # alone on an agent (planner/relay.py)
            "reason": plan.decision.reason if plan else None,
            "world_size": 1 + len(self.membership.to_resources()) if self.membership else 1,
            "engine": engine,
            "speeds": self.survey.status() if self.survey is not None else None,
            "predicted": predicted_status(
                plan.predictions[0] if plan and plan.predictions else None, engine
            ),
            "served": self.served_speed.describe()
            | {"segments_ms": one_stream_segments_ms((engine or {}).get("step_timing"))},
            "coordinator": resources_status(self.coordinator())
            | {"memory_accounting": _memory_accounting(runner)},
            "members": members_status(self.membership),
            "model": self.facts.to_dict(),
        }
        pressure = self.service.pressure
        if pressure is not None:  # memory tiers (engines/cluster/pressure.py)
            body["coordinator"] |= pressure.coordinator_memory()
            body["memory_pressure"] = pressure.describe()
        return body

    def close(self, state: str = "stopping", reason: str = "server is shutting down") -> None:
        """Stop watching (waiting for a launch in progress), then close the engine; the
        service is left in `state`."""
        with self._lock:
            self._closed.set()
            runner = self.service.runner
            self.service.swap_runner(None, state, reason)
            retired, self._retired = self._retired, []
            move = self._move
        if move is not None:
            move.cancel()  # the others moving stop waiting for this model's release
        if self._watcher.is_alive():
            self._watcher.join(WATCHER_JOIN_S)
        for old in [*retired, runner]:
            if old is not None:
                old.close()
        self._release_workers("coordinator shutting down")


def describe_part(plan: ClusterPlan, node_id: str) -> str | None:
    """'tensor-parallel rank 1 on node X' or 'pipeline stage 2 (layers [8, 12)) on node X';
    None when the node has no part in the plan."""
    if is_relayed(plan) and node_id == plan.ranks[1]:
        return f"the model alone on node {node_id} (relayed by the coordinator)"
    if plan.decision.chosen == Parallelism.TP and node_id in plan.ranks:
        return f"tensor-parallel rank {plan.ranks.index(node_id)} on node {node_id}"
    for index, stage in enumerate(plan.stages):
        if stage.node_id == node_id:
            layers = f"[{stage.layers.start}, {stage.layers.stop})"
            return f"pipeline stage {index} (layers {layers}) on node {node_id}"
    return None


def _unhealthy(engine: Engine) -> str:
    """The re-plan reason for an engine that noticed a loss itself: its own account of it."""
    info = engine.info()
    why = info.detail.get("lost_reason") or info.detail.get("failure")
    return f"{info.strategy} engine became unhealthy" + (f": {why}" if why else "")


def predicted_status(
    prediction: Prediction | None, engine: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The running plan's prediction; once its engine has drafted, also its 1-stream speed at
    the acceptance measured so far (planner/speed.py predict_speculating)."""
    if prediction is None:
        return None
    counts = (engine or {}).get("speculation") or {}
    speculating = predict_speculating(
        prediction, counts.get("steps", 0), counts.get("drafted", 0), counts.get("accepted", 0)
    )
    body = prediction.to_dict()
    if speculating is not None:
        body["speculating"] = speculating.to_dict()
    return body


def active_rdma(hello: Any) -> tuple[str, ...]:
    """The RDMA devices a member's hello reports with an active port (JACCL's links)."""
    return tuple(d.name for d in hello.rdma_devices if d.port_state == PORT_ACTIVE)


def _assignment(plan: ClusterPlan | None) -> tuple[Any, ...]:
    """What a plan runs where; two plans with equal assignments need no re-plan."""
    if plan is None:
        return ()
    stages = tuple((s.node_id, s.layers.start, s.layers.stop) for s in plan.stages)
    return (plan.decision.chosen, tuple(plan.ranks), stages)


def _memory_accounting(runner: EngineRunner | None) -> dict[str, Any]:
    """This machine's serving processes by kind of memory: the API's and the engine core's
    when the core runs apart ("api", "engine_core"), else serve's own ("serve")."""
    if runner is None:
        return {"serve": process_memory(None)}
    return runner.memory_accounting()
