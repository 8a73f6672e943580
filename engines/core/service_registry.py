"""ServiceRegistry: every model this server serves, each behind a Service of its own, and the
one question every API route asks of them: which model does a request's `model` name?
It holds Services (not cli/served_model.py's ServedModel, the coordinator's bundle of a
Service with its supervisor and weight server).

A model is listed from when it is known until it is unloaded through the API; its Service's
state says whether it answers ("ok"), is loading ("starting"), re-planning ("degraded"),
unloading, unloaded (--load-on-demand loads it when a request names it) or failed.
The first model added is the default: the one the browser pages open on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from engines.core.service import Service
from engines.observability.request_timing import RequestRecord


class OnDemand(Protocol):
    async def wait_loaded(self, model_id: str) -> Service:
        """The model's Service once it answers, loading it first if it is unloaded; raises
        EngineError when it failed to load or did not within the bound."""
        ...


class ServiceRegistry:
    def __init__(self, services: Iterable[Service] = ()) -> None:
        self.on_demand: OnDemand | None = None  # loads a model a request names (--load-on-demand)
        self.keep_alive_s = 0.0  # --keep-alive: an idle model is unloaded after this; 0: never
        self._lock = threading.Lock()
        self._services: dict[str, Service] = {}
        self._listeners: list[Callable[[RequestRecord], None]] = []
        for service in services:
            self.add(service)

    def add(self, service: Service) -> None:
        with self._lock:
            if service.model_id in self._services:
                raise ValueError(f"the model '{service.model_id}' is served already")
            self._services[service.model_id] = service
            service.request_listeners.extend(self._listeners)

    def replace(self, service: Service) -> None:
        """Put `service` in the place of the model with its id (reloaded: a Service of its
        own), keeping its order."""
        with self._lock:
            if service.model_id not in self._services:
                raise KeyError(service.model_id)
            self._services[service.model_id] = service
            service.request_listeners.extend(self._listeners)

    def listen(self, listener: Callable[[RequestRecord], None]) -> None:
        """Hand every model's finished requests to `listener` (metrics, dashboard, log),
        those of models added later too."""
        with self._lock:
            self._listeners.append(listener)
            for service in self._services.values():
                service.request_listeners.append(listener)

    def remove(self, model_id: str) -> Service | None:
        with self._lock:
            return self._services.pop(model_id, None)

    def all(self) -> list[Service]:
        with self._lock:
            return list(self._services.values())

    def ids(self) -> list[str]:
        return [service.model_id for service in self.all()]

    @property
    def default(self) -> Service:
        services = self.all()
        if not services:
            raise LookupError("no model is served")
        return services[0]

    def get(self, model_id: str) -> Service | None:
        with self._lock:
            return self._services.get(model_id)

    def find(self, requested: str) -> Service | None:
        """The model a request's `model` names: by id first, then by an alias (NAME may be a
        pattern such as 'claude-*'; the first model whose alias matches wins)."""
        services = self.all()
        exact = [service for service in services if service.model_id == requested]
        return next(iter(exact + [s for s in services if s.served_id(requested)]), None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._services)

    def describe_ids(self) -> str:
        """'a', or 'a', 'b' and 'c': for messages naming what is served."""
        quoted = [f"'{model_id}'" for model_id in self.ids()]
        if len(quoted) < 2:
            return "".join(quoted) or "no model"
        return f"{', '.join(quoted[:-1])} and {quoted[-1]}"
