"""The coordinator's offer of its model to agents: the weight server, started on first need."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path
from typing import Any

from planner.errors import ModelError

from .manifest import Manifest, build_manifest
from .server import WeightServer

log = logging.getLogger(__name__)


class WeightSource:
    """Hashes the model and starts the weight server the first time a plan needs it.

    `offer()` is what an assignment carries ({"host", "port", "content_hash"}); manifests are
    cached under `cache_dir` keyed by each file's size and mtime, so a restart does not
    re-hash an unchanged model.
    """

    def __init__(self, model_path: Path, cluster_key: bytes, host: str, cache_dir: Path) -> None:
        self.model_path = Path(model_path)
        self._key = cluster_key
        self._host = host
        self._cache_dir = Path(cache_dir)
        self._lock = threading.Lock()
        self._server: WeightServer | None = None

    def offer(self) -> dict[str, Any]:
        with self._lock:
            if self._server is None:
                server = WeightServer(self.model_path, self._manifest(), self._key, self._host)
                server.start()
                self._server = server
            return {
                "host": self._host,
                "port": self._server.port,
                "content_hash": self._server.manifest.content_hash,
            }

    def status(self) -> dict[str, Any]:
        server = self._server
        return server.status() if server is not None else {}

    def close(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.stop()
                self._server = None

    def _manifest(self) -> Manifest:
        stats = sorted(
            (str(file.relative_to(self.model_path)), file.stat().st_size, file.stat().st_mtime_ns)
            for file in self.model_path.rglob("*")
            if file.is_file()
        )
        key = hashlib.sha256(json.dumps([str(self.model_path.resolve()), stats]).encode())
        cached = self._cache_dir / "manifests" / f"{key.hexdigest()[:32]}.json"
        try:
            return Manifest.from_json(cached.read_text())
        except (OSError, ModelError):
            pass  # no cached manifest for these files yet
        manifest = build_manifest(self.model_path)
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(manifest.to_json())
        except OSError as error:
            log.warning("cannot cache the model manifest in %s: %s", cached, error)
        return manifest
