"""Hand the memory a retired engine freed back to the operating system.

Closing an engine drops its arrays, but the process keeps the pages: mlx keeps freed buffers
in its cache, reference cycles wait for the collector, and glibc keeps freed heap in its arenas
(one per thread that allocated), so RSS stays at its peak and every re-plan adds a model's
worth. This runs after a re-plan has closed the old engine.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import sys

import mlx.core as mx

log = logging.getLogger(__name__)


def release_freed_memory() -> None:
    """Collect cycles, empty mlx's buffer cache and trim glibc's heap (where there is one)."""
    gc.collect()
    mx.clear_cache()
    if sys.platform.startswith("linux"):
        _malloc_trim()


def _malloc_trim() -> None:
    try:
        # the process's own symbols, libc's among them (find_library would run ldconfig)
        libc = ctypes.CDLL(None)
        libc.malloc_trim(0)
    except (OSError, AttributeError) as error:  # musl has no malloc_trim
        log.debug("malloc_trim unavailable: %s", error)
