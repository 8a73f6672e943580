"""What this process holds as tandem knows it (weights, prefix cache, mlx's arrays and cache),
next to what the operating system says it uses (RSS), and what nothing accounts for.

`unaccounted` is RSS minus what mlx holds (its live arrays and its buffer cache): the Python
interpreter, the libraries and their heaps. It is roughly constant for a healthy server; a
number that grows across re-plans while the prefix cache does not is a leak.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import psutil
from mlx.utils import tree_flatten

# What an engine reports it holds in this process (Engine.memory_held), in bytes.
HELD_KINDS = ("weights", "prefix_cache")


def parameter_bytes(*modules: Any) -> int:
    """Bytes of every parameter of mlx modules (None skipped): what their weights hold."""
    return sum(
        array.nbytes
        for module in modules
        if module is not None
        for _, array in tree_flatten(module.parameters())
    )


def process_memory(engine: Any | None) -> dict[str, int]:
    """Bytes by kind: rss, mlx_active (of which weights, prefix_cache, other_mlx: the batch's
    KV and scratch), mlx_cache, unaccounted."""
    rss = psutil.Process().memory_info().rss
    active, cache = int(mx.get_active_memory()), int(mx.get_cache_memory())
    held = engine.memory_held() if engine is not None else {}
    known = {kind: int(held.get(kind, 0)) for kind in HELD_KINDS}
    return {
        "rss": rss,
        "mlx_active": active,
        **known,
        "other_mlx": max(0, active - sum(known.values())),
        "mlx_cache": cache,
        "unaccounted": max(0, rss - active - cache),
    }
