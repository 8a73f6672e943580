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
from engines.core.engine_options import EngineOptions


@dataclass(frozen=True)
class EngineSpec:
    """`factory` ("module:function") builds the engine from `arguments` (plain values that
    msgpack carries: the model, its layers, its stages) and `options`, how it runs;
    `listener`, a bound socket the engine takes over (the pipeline's return hop), crosses to
    a child process as an inherited descriptor."""

    factory: str
    arguments: dict[str, Any]
    options: EngineOptions = EngineOptions()
    listener: socket.socket | None = field(default=None, compare=False)

    def build(self, listener: socket.socket | None = None) -> Engine:
        """The engine, not loaded yet; BLAS threads set for this process."""
        blas.set_threads(self.options.blas_threads)
        make = resolve(self.factory)
        taken = listener if listener is not None else self.listener
        if taken is not None:
            return make(**self.arguments, options=self.options, listener=taken)
        return make(**self.arguments, options=self.options)

    def document(self) -> dict[str, Any]:
        """What crosses to the engine-core process (the listener goes as a descriptor)."""
        return {
            "factory": self.factory,
            "arguments": self.arguments,
            "options": self.options.document(),
        }

    @classmethod
    def from_document(cls, document: dict[str, Any]) -> EngineSpec:
        options = EngineOptions.from_document(document["options"])
        return cls(document["factory"], dict(document["arguments"]), options)


def resolve(name: str) -> Any:
    """The object a "module:attribute" name points at."""
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)
