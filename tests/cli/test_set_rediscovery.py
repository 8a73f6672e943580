"""When a set of models is placed again (cli/set_rediscovery.py), over planned models and a
scripted membership: a join moves one model and leaves the other alone, the same machines
move nothing, a loss alone moves nothing and a comeback counts as a join, and a model that
would move waits until it is idle."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cli.served_model import ModelChoice, ServedModel, placement_of
from cli.set_rediscovery import SetRediscovery
from engines.cluster.planning import PlanSettings
from engines.model.info import inspect_model
from planner import NodeResources, Parallelism

GiB = 2**30
COORDINATOR = NodeResources("coordinator", "127.0.0.1", 64 * GiB, ("ring",))


class ScriptedMembers:
    """Verified agents as the test sets them; memory readings drift on every look."""

    def __init__(self) -> None:
        self.present: list[str] = []
        self.looks = 0

    def to_resources(self) -> list[NodeResources]:
        self.looks += 1
        drift = self.looks * 1024 * 1024
        return [NodeResources(n, "10.0.0.2", 64 * GiB - drift, ("ring",)) for n in self.present]

    def members(self) -> list[Any]:
        return []


class ScriptedSupervisor:
    """What the set's placement reads of a supervisor; records the moves asked of it."""

    def __init__(self) -> None:
        self.plan_settings = PlanSettings(Parallelism.PP, "ring", 256, 4, 2)
        self.plan: Any = None
        self.member_group: frozenset[str] = frozenset()
        self.coordinator = lambda: COORDINATOR
        self.moves: list[tuple[frozenset[str], str]] = []

    def request_move(self, move: Any, reason: str) -> None:
        self.moves.append((move.group, reason))


@pytest.fixture
def models(demo_model_dir: Path) -> list[ServedModel]:
    """Two models served alone on the coordinator, idle."""
    facts = inspect_model(demo_model_dir)
    served = [
        ServedModel(
            facts,
            SimpleNamespace(model_id=name, runner=SimpleNamespace(idle=True)),
            ScriptedSupervisor(),
            ModelChoice(None, name),
        )
        for name in ("a", "b")
    ]
    placement = placement_of(served, COORDINATOR, ScriptedMembers())
    for model in served:
        model.supervisor.plan = placement.plans[model.service.model_id]
    return served


def moves_of(models: list[ServedModel]) -> dict[str, list[tuple[frozenset[str], str]]]:
    return {model.service.model_id: list(model.supervisor.moves) for model in models}


def rediscovery(models: list[ServedModel], members: ScriptedMembers) -> SetRediscovery:
    return SetRediscovery(lambda: models, threading.RLock(), COORDINATOR, members, 1.0)


def test_a_join_moves_one_model_and_the_same_machines_move_nothing_again(
    models: list[ServedModel],
) -> None:
    members = ScriptedMembers()
    watcher = rediscovery(models, members)
    watcher.check()
    assert moves_of(models) == {"a": [], "b": []}  # nobody joined

    members.present = ["agent-0"]
    watcher.check()
    moved = {m: found for m, found in moves_of(models).items() if found}
    assert len(moved) == 1, moves_of(models)
    ((group, reason),) = next(iter(moved.values()))
    assert group == {"agent-0"}
    assert reason == (
        "membership changed: agent-0 joined: placed again as pp=2 on coordinator, agent-0"
    )
    (stayed,) = [m for m in models if m.service.model_id not in moved]
    assert stayed.supervisor.member_group == frozenset()

    for _ in range(3):  # memory readings drift; who is present does not
        watcher.check()
    assert sum(len(found) for found in moves_of(models).values()) == 1


def test_a_loss_alone_moves_nothing_and_a_comeback_counts_as_a_join(
    models: list[ServedModel],
) -> None:
    members = ScriptedMembers()
    members.present = ["agent-0"]
    watcher = rediscovery(models, members)  # placed over agent-0 (here: it took no model)
    members.present = []
    watcher.check()
    assert moves_of(models) == {"a": [], "b": []}
    members.present = ["agent-0"]
    watcher.check()
    assert sum(len(found) for found in moves_of(models).values()) == 1


def test_a_model_that_would_move_waits_until_it_is_idle(models: list[ServedModel]) -> None:
    for model in models:
        model.service.runner.idle = False
    members = ScriptedMembers()
    watcher = rediscovery(models, members)
    members.present = ["agent-0"]
    watcher.check()
    watcher.check()
    assert moves_of(models) == {"a": [], "b": []}
    for model in models:
        model.service.runner.idle = True
    watcher.check()
    assert sum(len(found) for found in moves_of(models).values()) == 1
