"""DiskTier: one node's prefix-cache entries written to disk, read back on a hit.

Writing happens on a background thread so the token loop never waits on the disk; the
caches it writes were copied into fresh, evaluated arrays on the engine's thread, so the
writer never runs an mlx computation. Until its file is written an entry is served from
that copy. Files go through mlx-lm's own `save_prompt_cache` / `load_prompt_cache`.

The directory is this process's alone (`<root>/<pid>`): entries are named by the index of
one running engine and mean nothing to the next one, so `open` clears what processes that
are gone left behind, and `close` removes the directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import shutil
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

log = logging.getLogger(__name__)

_STOP = None  # the writer's queue item that ends it; an Event is a flush marker


class DiskTier:
    """Entry id -> a .safetensors file of its caches, and the tokens they hold."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.directory = self.root / str(os.getpid())
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[list[Any], tuple[int, ...]]] = {}  # not yet written
        self._written: dict[int, tuple[int, ...]] = {}
        self._sizes: dict[int, int] = {}
        self._queue: queue.Queue[int | threading.Event | None] = queue.Queue()
        self._writer: threading.Thread | None = None

    def open(self) -> None:
        """Create this process's directory, removing those of processes that are gone."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.iterdir():
            if stale.is_dir() and stale.name.isdigit() and not _alive(int(stale.name)):
                shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory.mkdir(parents=True)
        self._writer = threading.Thread(target=self._write_loop, name="prefix-disk", daemon=True)
        self._writer.start()

    def __contains__(self, entry_id: int) -> bool:
        with self._lock:
            return entry_id in self._pending or entry_id in self._written

    @property
    def nbytes(self) -> int:
        """Bytes of the files written so far."""
        with self._lock:
            return sum(self._sizes.values())

    def write(self, entry_id: int, caches: list[Any], tokens: tuple[int, ...]) -> None:
        """Engine thread: copy the entry's KV now, write it in the background."""
        copies = [_evaluated_copy(cache) for cache in caches]
        mx.eval([(copy.keys, copy.values) for copy in copies if copy.keys is not None])
        with self._lock:
            self._pending[entry_id] = (copies, tokens)
        self._queue.put(entry_id)

    def read(self, entry_id: int) -> tuple[list[Any], tuple[int, ...]]:
        """The entry's caches (fresh objects) and tokens, from its copy or its file."""
        with self._lock:
            pending = self._pending.get(entry_id)
            tokens = self._written.get(entry_id)
        if pending is not None:
            copies, tokens = pending
            return [_sharing(cache) for cache in copies], tokens
        if tokens is None:
            raise KeyError(entry_id)
        caches = load_prompt_cache(str(self._path(entry_id)))
        mx.eval([cache.state for cache in caches])
        return caches, tokens

    def drop(self, entry_id: int) -> None:
        with self._lock:
            self._pending.pop(entry_id, None)
            self._sizes.pop(entry_id, None)
            written = self._written.pop(entry_id, None) is not None
        if written:
            self._path(entry_id).unlink(missing_ok=True)

    def clear(self) -> None:
        with self._lock:
            entries = [*self._pending, *self._written]
        for entry_id in entries:
            self.drop(entry_id)

    def close(self) -> None:
        """Stop the writer and remove this process's directory."""
        if self._writer is not None:
            self._queue.put(_STOP)
            self._writer.join(timeout=30)
            self._writer = None
        with self._lock:
            self._pending.clear()
            self._written.clear()
            self._sizes.clear()
        shutil.rmtree(self.directory, ignore_errors=True)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every entry handed to `write` so far is on disk; False on timeout."""
        marker = threading.Event()
        self._queue.put(marker)
        return marker.wait(timeout_s)

    def _path(self, entry_id: int) -> Path:
        return self.directory / f"{entry_id}.safetensors"

    def _write_loop(self) -> None:
        while (entry_id := self._queue.get()) is not _STOP:
            if isinstance(entry_id, threading.Event):
                entry_id.set()
                continue
            with self._lock:
                pending = self._pending.get(entry_id)
            if pending is None:
                continue  # dropped before its turn
            caches, tokens = pending
            path = self._path(entry_id)
            try:
                save_prompt_cache(str(path), caches)
            except (OSError, RuntimeError, ValueError) as error:
                log.warning("prefix cache: cannot write entry %d to %s: %s", entry_id, path, error)
                with self._lock:
                    self._pending.pop(entry_id, None)
                continue
            with self._lock:
                if self._pending.pop(entry_id, None) is None:  # dropped while being written
                    path.unlink(missing_ok=True)
                    continue
                self._written[entry_id] = tokens
                self._sizes[entry_id] = path.stat().st_size


def tier_root(cache_dir: Path, model_path: Path, share: str) -> Path:
    """Where one node keeps one model's entries for one share of a plan ("single", "tp-1of2",
    "layers-0-7"), under the cache directory: entries of other models or shapes never mix."""
    model = Path(model_path).resolve()
    digest = hashlib.sha256(str(model).encode()).hexdigest()[:12]
    return Path(cache_dir) / f"{model.name}-{digest}" / share


def _evaluated_copy(cache: KVCache) -> KVCache:
    """A KVCache holding exactly its tokens' keys and values, in arrays of its own."""
    fresh = KVCache()
    if cache.keys is not None:
        keys, values = cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
        fresh.keys, fresh.values = mx.contiguous(keys), mx.contiguous(values)
        fresh.offset = cache.offset
    return fresh


def _sharing(cache: KVCache) -> KVCache:
    """A new KVCache over the same arrays (mlx arrays are values: its writes stay its own)."""
    fresh = KVCache()
    fresh.keys, fresh.values, fresh.offset = cache.keys, cache.values, cache.offset
    return fresh


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
