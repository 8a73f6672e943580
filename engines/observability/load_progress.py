"""Load progress: engines report the layers they have loaded; a progress bar may listen."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

log = logging.getLogger(__name__)

Listener = Callable[[int, int], None]  # (layers loaded, layers in all)

_listeners: list[Listener] = []
_lock = threading.Lock()


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Call `listener(done, total)` (from the loading thread) while the block runs."""
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)


def report(done: int, total: int) -> None:
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        try:
            listener(done, total)
        except Exception:  # a broken progress bar must not fail the load
            log.exception("load progress listener failed")


def evaluate_by_layer(model: Any) -> None:
    """Evaluate a lazily loaded model one layer at a time, reporting each, then the rest
    (embeddings, norm, head). The weights are read as each layer is evaluated, so this is
    the load itself, counted."""
    layers = list(getattr(model, "layers", None) or [])
    for index, layer in enumerate(layers, start=1):
        mx.eval(layer.parameters())
        report(index, len(layers))
    mx.eval(model.parameters())
