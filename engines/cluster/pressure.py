"""PressureController: the plan's memory tiers -> prefix-cache eviction at warn, 503 at critical."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from discovery.members import CONNECTED
from discovery.memory_monitor import MemoryMonitor
from discovery.memory_tiers import CRITICAL, OK, WARN, severity, worst_tier
from engines.core.service import Service
from errors import OverloadedError
from planner import ClusterPlan

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class PressureSettings:
    """How the coordinator reacts to memory tiers."""

    check_interval_s: float = 0.5
    # Pressure that outlasts this evicts again: long enough for the freed memory to show in the
    # next heartbeat (1 s apart by default), short enough to act before warn becomes critical.
    eviction_interval_s: float = 2.0
    # keep_fraction of each eviction round in one episode of pressure; the last one repeats.
    keep_fractions: tuple[float, ...] = (0.5, 0.5, 0.5, 0.0)
    retry_after_s: int = 5  # the Retry-After of a 503 at critical


def plan_node_ids(plan: ClusterPlan | None) -> set[str]:
    """Every node the plan runs on (ranks, stages, or the coordinator alone)."""
    if plan is None:
        return set()
    return set(plan.ranks) | {stage.node_id for stage in plan.stages}


def plan_tiers(
    plan: ClusterPlan | None, coordinator_id: str, coordinator_tier: str, members: Iterable[Any]
) -> dict[str, str]:
    """The tier of every node the plan runs on: the coordinator's own, and each connected
    member's last report. A node outside the plan holds no part of the model: it cannot run
    out of memory because of a request, and evicting does not help it."""
    in_plan = plan_node_ids(plan)
    tiers = {coordinator_id: coordinator_tier}
    for member in members:
        if member.node_id in in_plan and member.state == CONNECTED and member.memory is not None:
            tiers[member.node_id] = member.memory.tier
    return tiers


class PressureController:
    """Checks the tiers every `check_interval_s` on its own thread.

    At warn on any node it asks the runner to evict prefix-cache entries on every node, and
    again every `eviction_interval_s` while the pressure lasts, keeping less each round, until
    every node is ok. At critical it also refuses new requests (OverloadedError: 503 with
    Retry-After); what is queued or running continues.
    """

    def __init__(
        self,
        service: Service,
        tiers: Callable[[], Mapping[str, str]],
        settings: PressureSettings | None = None,
        monitor: MemoryMonitor | None = None,  # the coordinator's own, for /v1/cluster
    ) -> None:
        self.service = service
        self.settings = settings or PressureSettings()
        self.monitor = monitor
        self._read_tiers = tiers
        self._lock = threading.Lock()
        self._tiers: dict[str, str] = {}
        self.tier = OK
        self.refusal = ""  # why new requests are refused; empty while they are accepted
        self.eviction_requests = 0
        self.episodes = 0  # spells of pressure (warn or worse) that requested eviction
        self.refused_requests = 0
        self._round = 0  # eviction requests in the current episode
        self._next_eviction_at = 0.0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PressureController:
        self._thread = threading.Thread(target=self._run, name="memory-pressure", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop checking, and stop the monitor given to it."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(JOIN_TIMEOUT_S)
        if self.monitor is not None:
            self.monitor.stop()

    def _run(self) -> None:
        while not self._stopping.wait(self.settings.check_interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a bug here must not end pressure handling
                log.exception("memory pressure check failed")

    # -- one check ---------------------------------------------------------------------------

    def tick(self, now: float | None = None) -> str:
        """Read the tiers, evict or stop evicting, refuse or accept; returns the worst tier."""
        now = time.monotonic() if now is None else now
        tiers = dict(self._read_tiers())
        worst = worst_tier(tiers.values())
        self._log_changes(tiers)
        if severity(worst) >= severity(WARN):
            self._evict(worst, tiers, now)
        elif self._round:
            log.info("memory is ok on every node again after %d eviction request(s)", self._round)
            self._round, self._next_eviction_at = 0, 0.0
        refusal = describe_refusal(tiers) if worst == CRITICAL else ""
        with self._lock:
            if refusal and not self.refusal:
                log.warning("refusing new requests: %s", refusal)
            elif self.refusal and not refusal:
                log.info("accepting new requests again: memory is no longer critical anywhere")
            self._tiers, self.tier, self.refusal = tiers, worst, refusal
        return worst

    def _evict(self, worst: str, tiers: Mapping[str, str], now: float) -> None:
        runner = self.service.runner
        if now < self._next_eviction_at or runner is None:  # None: re-planning, nothing cached
            return
        fractions = self.settings.keep_fractions
        keep_fraction = fractions[min(self._round, len(fractions) - 1)]
        runner.request_prefix_eviction(keep_fraction)
        if self._round == 0:
            self.episodes += 1
        self._round += 1
        self.eviction_requests += 1
        self._next_eviction_at = now + self.settings.eviction_interval_s
        pressed = ", ".join(sorted(node for node, tier in tiers.items() if tier != OK))
        level = logging.WARNING if self._round == 1 else logging.INFO
        if self._round > len(fractions):  # pressure the cache cannot relieve: say it once
            level = logging.DEBUG
        log.log(
            level,
            "memory %s on %s: evicting prefix-cache entries on every node (keep %.0f%%, "
            "request %d of this episode)",
            worst,
            pressed,
            keep_fraction * 100,
            self._round,
        )

    def _log_changes(self, tiers: Mapping[str, str]) -> None:
        for node, tier in sorted(tiers.items()):
            previous = self._tiers.get(node, OK)
            if tier != previous:
                level = logging.WARNING if severity(tier) > severity(previous) else logging.INFO
                log.log(level, "node %s memory tier %s -> %s", node, previous, tier)

    # -- what the API and /v1/cluster ask ----------------------------------------------------

    def check_admission(self) -> None:
        """Raise OverloadedError while a node's memory is critical (from the event loop)."""
        with self._lock:
            refusal = self.refusal
            if refusal:
                self.refused_requests += 1
        if refusal:
            retry_s = self.settings.retry_after_s
            raise OverloadedError(f"{refusal}; retry in {retry_s} s", retry_after_s=retry_s)

    def health(self) -> dict[str, Any]:
        with self._lock:
            return {"memory_tier": self.tier, "memory_tiers": dict(self._tiers)}

    def coordinator_memory(self) -> dict[str, Any]:
        """The coordinator's own entry: its memory_tier and the sample behind it."""
        if self.monitor is None:
            return {}
        sample = self.monitor.latest()
        return {"memory_tier": sample.tier, "memory": sample.to_dict()}

    def describe(self) -> dict[str, Any]:
        """The /v1/cluster "memory_pressure" section."""
        runner = self.service.runner
        with self._lock:
            return {
                "tier": self.tier,
                "tiers": dict(self._tiers),
                "refusing_new_requests": bool(self.refusal),
                "reason": self.refusal,
                "episodes": self.episodes,
                "eviction_requests": self.eviction_requests,
                "refused_requests": self.refused_requests,
                "engine_evictions": runner.prefix_evictions if runner else 0,
                "engine_evicted_bytes": runner.prefix_evicted_bytes if runner else 0,
                "retry_after_s": self.settings.retry_after_s,
            }


def watch_memory(
    service: Service, supervisor: Any, coordinator_id: str, budget: int | None
) -> PressureController:
    """`tandem serve`'s own memory monitor and the controller over the supervisor's plan,
    both started; the controller's close() stops both."""
    monitor = MemoryMonitor(budget, label=coordinator_id, log_changes=False).start()

    def tiers() -> dict[str, str]:
        membership = supervisor.membership
        members = membership.members() if membership is not None else []
        return plan_tiers(supervisor.plan, coordinator_id, monitor.latest().tier, members)

    return PressureController(service, tiers, monitor=monitor).start()


def describe_refusal(tiers: Mapping[str, str]) -> str:
    critical = ", ".join(sorted(node for node, tier in tiers.items() if tier == CRITICAL))
    return (
        f"memory is critical on {critical}: new requests are refused until it recovers "
        "(requests already accepted continue)"
    )
