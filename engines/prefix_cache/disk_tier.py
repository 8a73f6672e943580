"""DiskTier: one node's prefix-cache entries on disk, read back on a hit, kept across restarts.

Writing happens on a background thread so the token loop never waits on the disk; the
caches it writes were copied into fresh, evaluated arrays on the engine's thread, so the
writer never runs an mlx computation. Until its file is written an entry is served from
that copy. Files go through mlx-lm's own `save_prompt_cache` / `load_prompt_cache`.

Each entry is two files named by a digest of its id and tokens (a pp stage knows only how
many tokens an entry holds, not which): `<key>.safetensors` (the caches) and,
written after it, `<key>.json` (the tokens, the first file's size and BLAKE2 digest, and
the tier's identity: model and share). An entry without its .json (a torn write), whose
digest does not match (corrupt) or whose identity is another's (a different model or plan
share) is never used. The directory is namespaced by model and share (`tier_root`) and
locked by one process at a time; a second process with the same namespace gets a private
directory that goes when it closes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import queue
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from engines.model.kv_quantization import as_mlx_cache, as_sequence_cache
from engines.prefix_cache.kv_prefix import kv_prefix

log = logging.getLogger(__name__)

_STOP = None  # the writer's queue item that ends it; an Event is a flush marker
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class StoredEntry:
    """An entry found on disk when the tier opened: what the index needs to list it."""

    key: str
    tokens: tuple[int, ...]
    nbytes: int


class DiskUnreadable(Exception):
    """An entry's file is missing, torn or corrupt: the lookup is a miss."""


class DiskTier:
    """Entry id -> a .safetensors file of its caches, and the tokens they hold."""

    def __init__(self, root: Path, identity: str = "") -> None:
        self.root = Path(root)
        self.identity = identity  # model and share: files of any other are ignored
        self.directory = self.root
        self._private = False
        self._lock_file: Any = None
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[list[Any], tuple[int, ...]]] = {}  # not yet written
        self._keys: dict[int, str] = {}  # written (or restored) entries -> file key
        self._sizes: dict[int, int] = {}
        self._queue: queue.Queue[int | threading.Event | None] = queue.Queue()
        self._writer: threading.Thread | None = None

    def open(self, keep_stored: bool = True) -> list[StoredEntry]:
        """Take the directory (or a private one when another process holds it); returns
        the valid entries a previous run left, for the index to list again (or, without
        `keep_stored`, removes them)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.root / ".lock", "w")  # noqa: SIM115 (held until close)
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            self._private = True
            self.directory = self.root / f"private-{os.getpid()}"
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory.mkdir()
        self._writer = threading.Thread(target=self._write_loop, name="prefix-disk", daemon=True)
        self._writer.start()
        if self._private:
            return []
        stored = self._stored_entries()
        if keep_stored:
            return stored
        for entry in stored:
            self._remove_files(entry.key)
        return []

    def adopt(self, entry_id: int, stored: StoredEntry) -> None:
        """List an entry found by `open` under the id the index gave it."""
        with self._lock:
            self._keys[entry_id] = stored.key
            self._sizes[entry_id] = stored.nbytes

    def discard(self, stored: StoredEntry) -> None:
        """Remove the files of an entry found by `open` that will not be listed or adopted (a
        tp rank's or pp stage's entry that another lacks)."""
        self._remove_files(stored.key)

    def entry_key(self, entry_id: int, tokens: tuple[int, ...]) -> str:
        """The name of an entry's two files: a digest of its id and tokens. (A pp stage, which
        knows no tokens, names them otherwise: engines/pipeline/chain_disk.py.)"""
        return hashlib.blake2b(repr((entry_id, tokens)).encode(), digest_size=12).hexdigest()

    def __contains__(self, entry_id: int) -> bool:
        with self._lock:
            return entry_id in self._pending or entry_id in self._keys

    def nbytes_on_disk(self) -> int:
        """Bytes of entry files in the directory now (a previous run's included)."""
        return sum(path.stat().st_size for path in self.directory.glob("*.safetensors"))

    @property
    def nbytes(self) -> int:
        """Bytes of the files written so far."""
        with self._lock:
            return sum(self._sizes.values())

    def write(self, entry_id: int, caches: list[Any], tokens: tuple[int, ...]) -> None:
        """Engine thread: copy the entry's KV now, write it in the background."""
        copies = [kv_prefix(cache, cache.offset, own=True) for cache in caches]
        mx.eval([copy.state for copy in copies if copy.keys is not None])
        with self._lock:
            self._pending[entry_id] = (copies, tuple(tokens))
        self._queue.put(entry_id)

    def read(self, entry_id: int) -> tuple[list[Any], tuple[int, ...]]:
        """The entry's caches (fresh objects) and tokens, from its copy or its verified file;
        DiskUnreadable when the file is missing, torn or corrupt."""
        with self._lock:
            pending = self._pending.get(entry_id)
            key = self._keys.get(entry_id)
        if pending is not None:
            copies, tokens = pending
            return [kv_prefix(cache, cache.offset) for cache in copies], tokens
        if key is None:
            raise DiskUnreadable(f"entry {entry_id} is not on disk")
        stored = self._verified(key)
        try:
            # a quantized entry comes back as mlx-lm's class: tandem's batches need its own
            caches = [
                as_sequence_cache(cache) for cache in load_prompt_cache(str(self._data_path(key)))
            ]
            mx.eval([cache.state for cache in caches])
        except (OSError, RuntimeError, ValueError) as error:
            raise DiskUnreadable(f"entry {entry_id}: {error}") from error
        return caches, stored.tokens

    def drop(self, entry_id: int) -> None:
        with self._lock:
            self._pending.pop(entry_id, None)
            self._sizes.pop(entry_id, None)
            key = self._keys.pop(entry_id, None)
        if key is not None:
            self._remove_files(key)

    def clear(self) -> None:
        """Forget every entry and remove its files (the ids they were named by are void)."""
        with self._lock:
            keys = list(self._keys.values())
            self._pending.clear()  # one being written now is removed when it is done
            self._keys.clear()
            self._sizes.clear()
        for key in keys:
            self._remove_files(key)

    def close(self) -> None:
        """Stop the writer (what it was given is written first); the files stay for the next
        run, except in a private directory."""
        if self._writer is not None:
            self._queue.put(_STOP)
            self._writer.join(timeout=60)
            self._writer = None
        with self._lock:
            self._pending.clear()
            self._keys.clear()
            self._sizes.clear()
        if self._private:
            shutil.rmtree(self.directory, ignore_errors=True)
        if self._lock_file is not None:
            self._lock_file.close()  # releases the lock
            self._lock_file = None

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every entry handed to `write` so far is on disk; False on timeout."""
        marker = threading.Event()
        self._queue.put(marker)
        return marker.wait(timeout_s)

    # -- files ---------------------------------------------------------------------------

    def _data_path(self, key: str) -> Path:
        return self.directory / f"{key}.safetensors"

    def _meta_path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def _remove_files(self, key: str) -> None:
        self._meta_path(key).unlink(missing_ok=True)  # first: without it the data is ignored
        self._data_path(key).unlink(missing_ok=True)

    def _stored_entries(self) -> list[StoredEntry]:
        entries = []
        for meta in sorted(self.directory.glob("*.json"), key=lambda path: path.stat().st_mtime):
            try:
                entries.append(self._verified(meta.stem, check_digest=False))
            except DiskUnreadable as error:
                log.info("prefix cache: ignoring %s on disk: %s", meta.stem, error)
                self._remove_files(meta.stem)
        for data in self.directory.glob("*.safetensors"):  # torn writes: data, no .json
            if not self._meta_path(data.stem).exists():
                data.unlink(missing_ok=True)
        for temporary in self.directory.glob("*.tmp*"):
            temporary.unlink(missing_ok=True)
        return entries

    def _verified(self, key: str, check_digest: bool = True) -> StoredEntry:
        try:
            meta = json.loads(self._meta_path(key).read_text())
            data = self._data_path(key)
            size = data.stat().st_size
            if meta.get("identity") != self.identity:
                raise DiskUnreadable(f"written for {meta.get('identity')!r}")
            if size != meta["bytes"]:
                raise DiskUnreadable(f"{size} bytes, {meta['bytes']} written")
            if check_digest and _digest(data) != meta["blake2b"]:
                raise DiskUnreadable("its content does not match its digest")
            return StoredEntry(key, tuple(int(token) for token in meta["tokens"]), size)
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise DiskUnreadable(f"{key}: {error}") from error

    def _write_loop(self) -> None:
        while (entry_id := self._queue.get()) is not _STOP:
            if isinstance(entry_id, threading.Event):
                entry_id.set()
                continue
            with self._lock:
                pending = self._pending.get(entry_id)
            if pending is not None:
                self._write_entry(entry_id, *pending)

    def _write_entry(self, entry_id: int, caches: list[Any], tokens: tuple[int, ...]) -> None:
        key = self.entry_key(entry_id, tokens)
        data, meta = self._data_path(key), self._meta_path(key)
        try:
            temporary = data.with_suffix(".tmp.safetensors")
            # mlx-lm's loader finds classes by name in its own module: save them as its own
            save_prompt_cache(str(temporary), [as_mlx_cache(cache) for cache in caches])
            os.replace(temporary, data)
            size = data.stat().st_size
            record = {
                "identity": self.identity, "tokens": list(tokens), "bytes": size,
                "blake2b": _digest(data),
            }  # fmt: skip
            meta.with_suffix(".tmp").write_text(json.dumps(record))
            os.replace(meta.with_suffix(".tmp"), meta)
        except (OSError, RuntimeError, ValueError) as error:
            log.warning("prefix cache: cannot write an entry to %s: %s", self.directory, error)
            with self._lock:
                self._pending.pop(entry_id, None)
            return
        with self._lock:
            if self._pending.pop(entry_id, None) is None:  # dropped while being written
                dropped = True
            else:
                dropped = False
                self._keys[entry_id] = key
                self._sizes[entry_id] = size
        if dropped:
            self._remove_files(key)


def tier_root(cache_dir: Path, model_path: Path, share: str) -> Path:
    """Where one node keeps one model's entries for one share of a plan ("single", "tp-1of2",
    "layers-0-7"), under the cache directory: entries of other models, of the same directory
    after its weights changed, or of other shares never mix."""
    model = Path(model_path).resolve()
    return Path(cache_dir) / f"{model.name}-{_model_digest(model)}" / share


def _model_digest(model: Path) -> str:
    """The model directory's path and its weight and config files' names, sizes and times."""
    hasher = hashlib.sha256(str(model).encode())
    for path in sorted([*model.glob("*.safetensors"), *model.glob("config.json")]):
        status = path.stat()
        hasher.update(f"{path.name}:{status.st_size}:{status.st_mtime_ns};".encode())
    return hasher.hexdigest()[:12]


def _digest(path: Path) -> str:
    hasher = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()
