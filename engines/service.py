"""Service: what the HTTP API talks to — the current engine runner, limits, and cluster status."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from planner.errors import EngineError

from .base import GenerationRequest
from .runner import EngineRunner, Submission


@dataclass(frozen=True, slots=True)
class ServiceLimits:
    """Operator limits applied to every request before it reaches an engine."""

    max_tokens_cap: int = 4096
    default_max_tokens: int = 256
    request_timeout_s: float = 300.0
    api_key: str | None = None  # when set, every /v1 request needs `Authorization: Bearer <key>`


@dataclass
class Service:
    """The API's single dependency. The cluster supervisor swaps `runner` on a re-plan.

    `state` is "ok", "degraded" (a rank or stage was lost; re-planning) or "starting".
    `cluster_status` returns the /v1/cluster body (decision, reason, members, model facts).
    """

    model_id: str
    tokenizer: Any
    model_revision: str | None = None  # the Hugging Face commit served, when from a repo
    limits: ServiceLimits = field(default_factory=ServiceLimits)
    runner: EngineRunner | None = None
    state: str = "starting"
    state_reason: str = ""
    cluster_status: Callable[[], dict[str, Any]] = dict
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def submit(self, request: GenerationRequest) -> Submission:
        """Queue on the current runner; raises QueueFullError or EngineError (503)."""
        with self._lock:
            runner = self.runner
        if runner is None:
            raise EngineError(f"no engine is serving right now ({self.state}: {self.state_reason})")
        return runner.submit(request)

    def swap_runner(self, runner: EngineRunner | None, state: str, reason: str = "") -> None:
        """Install a new runner (or none while re-planning); the old one is closed by the caller."""
        with self._lock:
            self.runner = runner
            self.state = state
            self.state_reason = reason

    def health(self) -> dict[str, Any]:
        runner = self.runner
        healthy = runner is not None and runner.engine.healthy()
        state = self.state if (healthy or self.state != "ok") else "degraded"
        return {
            "status": state,
            "reason": self.state_reason,
            "model": self.model_id,
            "active": runner.active if runner else 0,
            "max_batch": runner.max_batch if runner else 0,
            "queued": runner.queued if runner else 0,
            "queue_size": runner.queue_size if runner else 0,
        }
