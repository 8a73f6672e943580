"""EngineSpec: an engine to build — here, or in an engine-core process — as plain data.

The cluster launcher (engines/cluster/launch.py) describes the coordinator's part of a plan
this way instead of constructing it, so the same description builds the engine on a thread
of the serving process or crosses to a process of its own (engines/core/core_process.py).
"""

from __future__ import annotations

import importlib
import socket
from dataclasses import dataclass, field
from typing import Any

from engines.core import blas
from engines.core.engine import Engine


@dataclass(frozen=True)
class EngineSpec:
    """`factory` ("module:function") builds the engine from `options` (plain values that
    msgpack carries); `listener`, a bound socket the engine takes over (the pipeline's
    return hop), crosses to a child process as an inherited descriptor."""

    factory: str
    options: dict[str, Any]
    blas_threads: int = 0  # 0: the machine's default
    listener: socket.socket | None = field(default=None, compare=False)

    def build(self, listener: socket.socket | None = None) -> Engine:
        """The engine, not loaded yet; BLAS threads set for this process."""
        blas.set_threads(self.blas_threads)
        make = resolve(self.factory)
        taken = listener if listener is not None else self.listener
        if taken is not None:
            return make(**self.options, listener=taken)
        return make(**self.options)

    def document(self) -> dict[str, Any]:
        """What crosses to the engine-core process (the listener goes as a descriptor)."""
        return {"factory": self.factory, "options": self.options, "blas_threads": self.blas_threads}

    @classmethod
    def from_document(cls, document: dict[str, Any]) -> EngineSpec:
        return cls(document["factory"], dict(document["options"]), int(document["blas_threads"]))


def resolve(name: str) -> Any:
    """The object a "module:attribute" name points at."""
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)
