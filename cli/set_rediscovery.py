"""Machines that join a cluster serving a set of models after the set was placed, or come back
to it: the set is placed again over who is present (planner/placement.py), and each model the
new placement moves re-plans there through its own supervisor; the others keep serving.

Only a machine that joins counts: memory readings drift on their own, and placing the same
machines again would move models for nothing (as a single model's rediscovery reasons,
engines/cluster/supervisor.py); a machine lost re-plans only the model that used it, and
when it comes back it joins again. A refused placement moves nothing. A model that would move
while busy (a request running or queued, or re-planning) is waited for: as a single model
adopts a member only while idle, since the move ends what it is running."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from errors import TandemError
from planner import NodeResources

from .served_model import ServedModel, assign, coordinator_shares, group_of, placement_of

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5  # how soon a model waited for is moved once it is idle
BROWSE_S = 1.0  # one zeroconf browse, as a single model's rediscovery takes
JOIN_S = 5.0


class SetRediscovery:
    """Browses for agents every `interval_s` and places the set again when a machine joined
    since it was last placed; `lock` (an RLock) is the one loads and unloads hold."""

    def __init__(
        self,
        models: Callable[[], list[ServedModel]],
        lock: Any,
        coordinator: NodeResources,
        membership: Any,
        interval_s: float,
    ) -> None:
        self.models = models  # those holding memory
        self.lock = lock
        self.coordinator = coordinator
        self.membership = membership
        self.interval_s = interval_s
        self._placed_over = present(membership)  # who was present when the set was placed
        self._waiting_for: frozenset[str] | None = None  # logged once per membership
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="set rediscovery", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(JOIN_S)

    def _watch(self) -> None:
        next_browse = time.monotonic() + self.interval_s
        while not self._closed.wait(WATCH_INTERVAL_S):
            if time.monotonic() >= next_browse and self._serving_a_set():
                self._browse()
                next_browse = time.monotonic() + self.interval_s
            self.check()

    def check(self) -> None:
        """One look at who is present: place the set again when a machine joined."""
        with self.lock:
            now = present(self.membership)
            if not self._serving_a_set() or now <= self._placed_over:
                # a loss re-plans only the model that used the machine (its supervisor); when
                # the machine comes back, it joins again
                self._placed_over = now
            elif self._place_again(self.models(), now):
                self._placed_over = now

    def _serving_a_set(self) -> bool:
        """Models placed in groups (one model alone re-plans over every member itself, and
        browses itself)."""
        with self.lock:
            models = self.models()
        return bool(models) and all(m.supervisor.member_group is not None for m in models)

    def _browse(self) -> None:
        try:
            self.membership.discover(BROWSE_S)
        except TandemError as error:
            log.debug("re-discovery failed: %s", error)

    def _place_again(self, models: list[ServedModel], now: frozenset[str]) -> bool:
        """Place `models` over who is present `now` and move those whose machines or strategy
        change; False when one of those is busy (tried again shortly)."""
        from planner.placement import label, runs_on
        from planner.relay import is_relayed

        change = describe_change(self._placed_over, now)
        placement = placement_of(models, self.coordinator, self.membership)
        if placement.refusal is not None:
            log.warning("%s, but the set cannot be placed again: %s", change, placement.refusal)
            return True
        moving = [m for m in models if where(m.supervisor.plan) != where(placement.plans[id_of(m)])]
        busy = [id_of(m) for m in moving if not idle(m)]
        if busy:
            if self._waiting_for != now:
                self._waiting_for = now
                log.info("%s: moving %s once idle", change, ", ".join(busy))
            return False
        from engines.cluster.group_move import group_moves

        moving_ids = {id_of(model) for model in moving}
        what = f"moving {', '.join(sorted(moving_ids))}" if moving else "nothing moves"
        log.info("%s: %s", change, what)
        for line in placement.describe() if moving else ():
            log.info("placement: %s", line)
        shares = coordinator_shares(placement, self.coordinator)
        for model in models:  # the models that stay plan their next re-plan over the new share
            if id_of(model) not in moving_ids:
                assign(model, placement, shares[id_of(model)])
        relays = frozenset(m for m in moving_ids if is_relayed(placement.plans[m]))
        moves = group_moves({m: group_of(placement, m) for m in moving_ids}, shares, relays)
        for model in moving:
            plan = placement.plans[id_of(model)]
            reason = f"{change}: placed again as {label(plan)} on {runs_on(plan)}"
            model.supervisor.request_move(moves[id_of(model)], reason)
        return True


def present(membership: Any) -> frozenset[str]:
    """The verified, connected members now."""
    return frozenset(node.node_id for node in membership.to_resources())


def describe_change(before: frozenset[str], now: frozenset[str]) -> str:
    """'membership changed: node-a joined, node-b left'."""
    parts = [f"{node} joined" for node in sorted(now - before)]
    parts += [f"{node} left" for node in sorted(before - now)]
    return "membership changed: " + ", ".join(parts)


def where(plan: Any) -> tuple[Any, frozenset[str]]:
    """What a move changes: the strategy and the machines (not layer boundaries, which follow
    memory readings)."""
    if plan is None:
        return (None, frozenset())
    return (plan.decision.chosen, frozenset(plan.ranks))


def idle(model: ServedModel) -> bool:
    runner = model.service.runner
    return runner is not None and runner.idle


def id_of(model: ServedModel) -> str:
    return model.service.model_id
