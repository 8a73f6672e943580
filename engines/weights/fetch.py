"""An agent's side: fetch a model by content hash into its cache, verified and resumable."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from discovery.framing import connect
from discovery.secure_channel import SecureChannel
from engines.weights.manifest import MANIFEST_NAME, FileEntry, Manifest, hash_prefix
from engines.weights.server import HANDSHAKE_TIMEOUT_S, MAX_FRAME_BYTES, PURPOSE
from errors import ChannelError, ModelError
from planner import DISK_MARGIN_BYTES

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 30.0
ATTEMPTS = 5  # connections per fetch; each resumes where the last one stopped
PROGRESS_EVERY_S = 2.0
REPORT_EVERY_S = 1.0  # progress events to the coordinator: each one extends its wait

# (bytes of the copy present so far, its total bytes), at most every REPORT_EVERY_S
ProgressCallback = Callable[[int, int], None]


def cached_model(cache_root: Path, content_hash: str) -> Path | None:
    """The complete, verified copy of `content_hash` in `cache_root`, if there is one."""
    path = Path(cache_root) / content_hash
    try:
        manifest = Manifest.from_json((path / MANIFEST_NAME).read_text())
    except (OSError, ModelError):
        return None
    if manifest.content_hash != content_hash:
        return None
    for entry in manifest.files:
        file = path / entry.name
        if not file.is_file() or file.stat().st_size != entry.size:
            return None
    return path


def fetch_model(
    host: str,
    port: int,
    cluster_key: bytes,
    content_hash: str,
    cache_root: Path,
    *,
    attempts: int = ATTEMPTS,
    disk_free: Callable[[Path], int] | None = None,
    on_progress: ProgressCallback | None = None,
) -> Path:
    """The local directory holding `content_hash`, fetched from the weight server if needed.

    Files land as NAME.partial and are renamed once their SHA-256 matches the manifest; a
    broken connection is retried, resuming at each .partial file's end. The manifest file is
    written last, so a directory with one is complete. `on_progress` hears the bytes
    present so far while files arrive. Raises ModelError (disk too small,
    checksum mismatch, server unreachable after `attempts`).
    """
    found = cached_model(cache_root, content_hash)
    if found is not None:
        log.info("model %s already cached at %s: no transfer", content_hash[:12], found)
        if on_progress is not None:
            on_progress(0, 0)  # nothing to receive
        return found
    target = Path(cache_root) / content_hash
    target.mkdir(parents=True, exist_ok=True)
    last_error: Exception | None = None
    for attempt in range(1, attempts + 1):
        try:
            with _open(host, port, cluster_key) as channel:
                manifest = _manifest(channel, content_hash)
                _check_disk(target, manifest, disk_free or _free_bytes)
                report = _Reporter(target, manifest, on_progress)
                for entry in manifest.files:
                    _fetch_file(channel, target, entry, content_hash, report)
                report(0, force=True)
            (target / MANIFEST_NAME).write_text(manifest.to_json())
            log.info("model %s fetched into %s", content_hash[:12], target)
            return target
        except ChannelError as error:
            last_error = error
            log.warning("weight transfer attempt %d/%d broke: %s", attempt, attempts, error)
            time.sleep(min(0.2 * attempt, 2.0))
    raise ModelError(
        f"cannot fetch model {content_hash[:12]} from {host}:{port} after {attempts} "
        f"attempts: {last_error}"
    )


def _open(host: str, port: int, cluster_key: bytes) -> SecureChannel:
    sock = connect(host, port, HANDSHAKE_TIMEOUT_S)
    return SecureChannel.client(sock, cluster_key, PURPOSE, HANDSHAKE_TIMEOUT_S, MAX_FRAME_BYTES)


def _manifest(channel: SecureChannel, content_hash: str) -> Manifest:
    """The manifest the server offers for `content_hash`, checked against that hash."""
    channel.send(json.dumps({"op": "manifest", "model": content_hash}).encode())
    answer = channel.recv(READ_TIMEOUT_S)
    try:
        refused = json.loads(answer).get("error")
    except (ValueError, AttributeError):
        refused = None
    if refused:
        raise ModelError(f"the weight server refused: {refused}")
    manifest = Manifest.from_json(answer)
    if manifest.content_hash != content_hash:
        raise ModelError(
            f"the weight server offers model {manifest.content_hash[:12]}, the plan names "
            f"{content_hash[:12]}"
        )
    return manifest


def _check_disk(target: Path, manifest: Manifest, disk_free: Callable[[Path], int]) -> None:
    needed = 0
    for entry in manifest.files:
        done = target / entry.name
        partial = _partial(target, entry.name)
        if done.is_file() and done.stat().st_size == entry.size:
            continue
        needed += entry.size - (partial.stat().st_size if partial.is_file() else 0)
    free = disk_free(target)
    if needed + DISK_MARGIN_BYTES > free:
        raise ModelError(
            f"not enough disk for model {manifest.content_hash[:12]} in {target}: needs "
            f"{needed / 1e9:.2f} GB (+{DISK_MARGIN_BYTES / 1e9:.2f} GB margin), "
            f"{free / 1e9:.2f} GB free"
        )


class _Reporter:
    """Calls on_progress with the bytes of the copy present, at most every REPORT_EVERY_S."""

    def __init__(self, target: Path, manifest: Manifest, on_progress: ProgressCallback | None):
        self.total = manifest.total_bytes
        self.done = sum(_present(target, entry) for entry in manifest.files)
        self.on_progress = on_progress
        self.sent_at = float("-inf")

    def __call__(self, received: int, force: bool = False) -> None:
        self.done += received
        if self.on_progress is None:
            return
        if force or time.monotonic() - self.sent_at >= REPORT_EVERY_S:
            self.sent_at = time.monotonic()
            self.on_progress(min(self.done, self.total), self.total)


def _present(target: Path, entry: FileEntry) -> int:
    """Bytes of `entry` already here: all of it when verified, else its .partial file's."""
    done, partial = target / entry.name, _partial(target, entry.name)
    if done.is_file() and done.stat().st_size == entry.size:
        return entry.size
    return min(partial.stat().st_size, entry.size) if partial.is_file() else 0


def _fetch_file(
    channel: SecureChannel,
    target: Path,
    entry: FileEntry,
    content_hash: str,
    report: Callable[[int], None] = lambda received: None,
) -> None:
    done = target / entry.name
    if done.is_file() and done.stat().st_size == entry.size:
        return  # verified when it was renamed into place
    partial = _partial(target, entry.name)
    partial.parent.mkdir(parents=True, exist_ok=True)
    offset = partial.stat().st_size if partial.is_file() else 0
    if offset > entry.size:
        partial.unlink()
        offset = 0
    digest = hash_prefix(partial, offset) if offset else hashlib.sha256()
    if offset:
        log.info("resuming %s at byte %d of %d", entry.name, offset, entry.size)
    request = {"op": "read", "model": content_hash, "name": entry.name, "offset": offset}
    channel.send(json.dumps(request).encode())
    remaining = int(json.loads(channel.recv(READ_TIMEOUT_S))["size"])
    if remaining != entry.size - offset:
        raise ModelError(f"the weight server offers {remaining} bytes of {entry.name}")
    started, shown, received = time.monotonic(), time.monotonic(), 0
    with open(partial, "ab") as handle:
        while remaining > 0:
            block = channel.recv(READ_TIMEOUT_S)
            if not block or len(block) > remaining:
                raise ModelError(f"the weight server sent a bad block of {entry.name}")
            handle.write(block)
            digest.update(block)
            remaining -= len(block)
            received += len(block)
            report(len(block))
            if time.monotonic() - shown >= PROGRESS_EVERY_S:
                shown = time.monotonic()
                log.info(
                    "fetching %s: %.1f / %.1f MB (%.0f MB/s)",
                    entry.name,
                    (entry.size - remaining) / 1e6,
                    entry.size / 1e6,
                    received / 1e6 / (shown - started),
                )
        handle.flush()
        os.fsync(handle.fileno())
    if digest.hexdigest() != entry.sha256:
        partial.unlink()
        raise ModelError(f"{entry.name} arrived corrupted (SHA-256 mismatch); deleted it")
    os.replace(partial, done)


def _partial(target: Path, name: str) -> Path:
    return target / f"{name}.partial"


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def progress_events(output: Any) -> ProgressCallback:
    """A worker's progress line for the agent to relay (discovery/agent.py: Progress)."""

    def emit(done: int, total: int) -> None:
        output.write({"event": "progress", "done_bytes": done, "total_bytes": total})

    return emit


def model_for_assignment(
    reference: str | Path,
    weights: dict | None,
    cluster_key: bytes | None,
    on_progress: ProgressCallback | None = None,
) -> Path:
    """Where a worker finds its model: the reference resolved here (a directory, or repo@commit
    in this machine's Hugging Face cache), else the coordinator's copy fetched into the
    agent's cache (`weights`: host, port, content_hash, cache_dir)."""
    from engines.model.reference import local_model_path

    try:
        found = local_model_path(reference)
    except ModelError as error:
        if not weights or cluster_key is None or "cache_dir" not in weights:
            raise
        log.info("model %s is not on this machine (%s): fetching it", reference, error)
    else:
        if weights and on_progress is not None:  # the coordinator waits to hear it
            on_progress(0, 0)  # found here: nothing to receive
        return found
    root, limit = Path(str(weights["cache_dir"])), weights.get("disk_limit")
    return fetch_model(
        str(weights["host"]),
        int(weights["port"]),
        cluster_key,
        str(weights["content_hash"]),
        root,
        on_progress=on_progress,
        disk_free=None if limit is None else _within(root, int(limit)),
    )


def _within(root: Path, limit: int) -> Callable[[Path], int]:
    """Free disk as the agent's --disk-limit leaves it for everything under `root`."""
    from discovery.model_cache import used_bytes

    return lambda path: min(_free_bytes(path), max(limit - used_bytes(root), 0))
