"""A model of a set moving to other machines (the set placed again after the membership
changed, cli/set_rediscovery.py): its new group and share of the coordinator, and the barrier
every model that moves passes once its old workers are released, so that none starts a worker
on a machine another model is still leaving (an agent runs one worker; a second assignment
fails, and failing excludes the agent)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from planner import NodeResources

log = logging.getLogger(__name__)

MOVE_WAIT_S = 30.0  # for the others' releases (each waits up to RELEASE_WAIT_S for its agents)


@dataclass(frozen=True, slots=True)
class GroupMove:
    """Where one model re-plans: `group` (its members), `coordinator` (its share), and
    whether it runs alone on its one member, relayed (planner/relay.py)."""

    group: frozenset[str]
    coordinator: Callable[[], NodeResources]
    released: threading.Barrier  # shared by every model of the same re-placement that moves
    relayed: bool = False

    def wait_for_the_others(self) -> None:
        """Block until every model that moves has released its old workers (or gave up)."""
        try:
            self.released.wait(MOVE_WAIT_S)
        except threading.BrokenBarrierError:
            log.warning("moving before every other model moving confirmed its release")

    def cancel(self) -> None:
        """This model will not move (it is closing): the others stop waiting for it."""
        self.released.abort()


def group_moves(
    groups: dict[str, frozenset[str]],
    shares: dict[str, NodeResources],
    relays: frozenset[str] = frozenset(),
) -> dict[str, GroupMove]:
    """One GroupMove per model id in `groups` (those in `relays` relayed), all behind one
    barrier."""
    if not groups:
        return {}
    released = threading.Barrier(len(groups))
    return {
        model_id: GroupMove(
            group, lambda share=shares[model_id]: share, released, model_id in relays
        )
        for model_id, group in groups.items()
    }
