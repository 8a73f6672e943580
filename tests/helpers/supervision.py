"""A supervisor around a scripted engine and scripted members: lifecycle races, no mlx."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engines.cluster.launch import LaunchSettings
from engines.cluster.planning import PlanSettings
from engines.cluster.supervisor import ClusterSupervisor
from engines.core.engine import Engine, EngineInfo, StepOutput
from engines.core.request import GenerationRequest
from engines.core.service import Service
from engines.model.info import inspect_model
from errors import EngineError
from planner import NodeResources, Parallelism

GiB = 2**30
WAIT_S = 5.0


class ScriptedEngine(Engine):
    """Loads when `gate` opens (abort opens it and fails the load), or at once without a
    gate; produces nothing; records the prefix-cache evictions the runner hands it."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.tokenizer = object()
        self.gate = gate
        self.aborted = threading.Event()
        self.closed = threading.Event()
        self.loaded = threading.Event()
        self.evictions: list[float] = []  # keep fractions the runner handed on

    def load(self) -> None:
        if self.gate is not None and not self.gate.wait(WAIT_S * 4):
            raise EngineError("the scripted load never opened")
        if self.aborted.is_set():
            raise EngineError("aborted while loading")
        self.loaded.set()

    def insert(self, uid: int, request: GenerationRequest) -> None:
        pass

    def remove(self, uids: Sequence[int]) -> None:
        pass

    def step(self) -> list[StepOutput]:
        return []

    def info(self) -> EngineInfo:
        return EngineInfo("single")

    def abort(self, reason: str) -> None:
        self.aborted.set()
        if self.gate is not None:
            self.gate.set()

    def close(self) -> None:
        self.closed.set()

    def evict_prefix_cache(self, keep_fraction: float) -> int:
        self.evictions.append(keep_fraction)
        return 100


class Members:
    """The part of Membership the supervisor plans with: two verified agents."""

    def __init__(self) -> None:
        self.released = 0

    def to_resources(self) -> list[NodeResources]:
        return [
            NodeResources(f"agent-{n}", f"127.0.0.{n + 2}", 64 * GiB, ("ring",)) for n in (0, 1)
        ]

    def members(self) -> list[Any]:
        return []

    def release_all(self, reason: str = "", wait_s: float = 0.0) -> bool:
        self.released += 1
        return True

    def discover(self, timeout_s: float) -> list[Any]:
        return []


def make_supervisor(
    model_dir: Path, factory: Any, membership: Any = None, ready_timeout_s: float = WAIT_S
) -> ClusterSupervisor:
    service = Service(model_id="m", tokenizer=None)
    settings = PlanSettings(Parallelism.PP, None, 256, 4, 2, rediscover_interval_s=0)
    launch = LaunchSettings(Path(model_dir), None, "127.0.0.1", ready_timeout_s=ready_timeout_s)
    coordinator = NodeResources("coordinator", "127.0.0.1", 64 * GiB, ("ring",))
    return ClusterSupervisor(
        service,
        inspect_model(model_dir),
        settings,
        launch,
        lambda: coordinator,
        membership,
        engine_factory=factory,
    )
