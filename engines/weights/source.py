"""The coordinator's offer of its model to agents: the weight server, started on first need."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path
from typing import Any

from engines.model.info import WEIGHT_GLOB, inspect_model
from engines.model.reference import DOWNLOAD_PATTERNS
from engines.weights.manifest import FileEntry, Manifest, build_manifest
from engines.weights.server import CHUNK_BYTES, Offer, WeightServer, directory_offer
from engines.weights.subset import (
    SUBSET_FILE,
    RankShare,
    StageShare,
    VirtualFile,
    stage_file,
    subset_file,
)
from errors import ModelError

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"  # names the original shards: not in a share


class WeightSource:
    """Hashes the model and starts the weight server the first time a plan needs it.

    `offer(layers, is_last)` is what a stage assignment carries ({"host", "port",
    "content_hash"}): the stage's share only (its layers, plus the head on the last stage),
    as one safetensors file read straight from the original files; `offer_rank(rank,
    world_size)` likewise a tp rank's (its slices of what `Model.shard` cuts, the rest
    whole). Manifests are cached under `cache_dir`, keyed by every file's size and mtime,
    so a restart re-hashes nothing.
    """

    def __init__(self, model_path: Path, cluster_key: bytes, host: str, cache_dir: Path) -> None:
        self.model_path = Path(model_path)
        self._key = cluster_key
        self._host = host
        self._cache_dir = Path(cache_dir)
        self._lock = threading.Lock()
        self._server: WeightServer | None = None
        self._shares: dict[StageShare | RankShare, str] = {}

    def offer(self, layers: range | None = None, is_last: bool = False) -> dict[str, Any]:
        """Where to fetch the whole model (layers None) or the share of a stage."""
        with self._lock:
            server = self._start()
            if layers is None:
                content_hash = server.manifest.content_hash
            else:
                share = StageShare(
                    layers.start, layers.stop, layers.start == 0, is_last, self._tied()
                )
                content_hash = self._share_hash(share, server)
            return {"host": self._host, "port": server.port, "content_hash": content_hash}

    def offer_rank(self, rank: int, world_size: int) -> dict[str, Any]:
        """Where tp rank `rank` of `world_size` fetches its share (as `offer`)."""
        with self._lock:
            server = self._start()
            content_hash = self._share_hash(RankShare(rank, world_size), server)
            return {"host": self._host, "port": server.port, "content_hash": content_hash}

    def _share_hash(self, share: StageShare | RankShare, server: WeightServer) -> str:
        if share not in self._shares:
            self._shares[share] = server.add(self._share_offer(share, server.manifest))
        return self._shares[share]

    def status(self) -> dict[str, Any]:
        server = self._server
        return server.status() if server is not None else {}

    def content_hash(self) -> str:
        """The whole model's content hash (hashes every file once; cached by size and mtime)."""
        with self._lock:
            if self._server is not None:
                return self._server.manifest.content_hash
            return self._cached("model", lambda: build_manifest(self.model_path)).content_hash

    def model_bytes(self) -> int:
        """Bytes of every file a whole copy holds (no hashing)."""
        return sum(
            file.stat().st_size
            for file in {f for p in DOWNLOAD_PATTERNS for f in self.model_path.glob(p)}
            if file.is_file()
        )

    def close(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.stop()
                self._server = None

    def _start(self) -> WeightServer:
        if self._server is None:
            whole = self._cached("model", lambda: build_manifest(self.model_path))
            server = WeightServer(self.model_path, whole, self._key, self._host)
            server.start()
            self._server = server
        return self._server

    def _tied(self) -> bool:
        return inspect_model(self.model_path).tied_embeddings

    def _share_offer(self, share: StageShare | RankShare, whole: Manifest) -> Offer:
        virtual = self._share_file(share)
        weights = set(self.model_path.glob(WEIGHT_GLOB))

        def build() -> Manifest:
            kept = [
                entry
                for entry in whole.files
                if self.model_path / entry.name not in weights and entry.name != INDEX_FILE
            ]
            entry = FileEntry(SUBSET_FILE, virtual.size, virtual.sha256())
            subset = f"{share.describe()} of {whole.content_hash}"
            return Manifest(tuple(sorted([*kept, entry], key=lambda e: e.name)), subset)

        key = f"{whole.content_hash}-{_share_key(share)}"
        manifest = self._cached(key, build)
        files = directory_offer(self.model_path, manifest)

        def read(name: str, offset: int):
            if name != SUBSET_FILE:
                return files.read(name, offset)
            return _chunked(virtual.blocks(offset))

        log.info(
            "offering %s: %.1f MB of %.1f MB",
            manifest.subset,
            manifest.total_bytes / 1e6,
            whole.total_bytes / 1e6,
        )
        return Offer(manifest, read)

    def _share_file(self, share: StageShare | RankShare) -> VirtualFile:
        if isinstance(share, StageShare):
            return stage_file(self.model_path, share)
        from engines.weights.tp_share import rank_slices, share_metadata  # imports mlx

        slices = rank_slices(self.model_path, share)  # mlx-lm's Model.shard decides
        metadata = share_metadata(self.model_path, slices)
        return subset_file(self.model_path, lambda name: True, slices, share.describe(), metadata)

    def _cached(self, what: str, build) -> Manifest:
        stats = sorted(
            (str(file.relative_to(self.model_path)), file.stat().st_size, file.stat().st_mtime_ns)
            for file in self.model_path.rglob("*")
            if file.is_file()
        )
        key = hashlib.sha256(json.dumps([what, str(self.model_path.resolve()), stats]).encode())
        cached = self._cache_dir / "manifests" / f"{key.hexdigest()[:32]}.json"
        try:
            return Manifest.from_json(cached.read_text())
        except (OSError, ModelError):
            pass  # no cached manifest for these files yet
        manifest = build()
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(manifest.to_json())
        except OSError as error:
            log.warning("cannot cache the model manifest in %s: %s", cached, error)
        return manifest


def _share_key(share: StageShare | RankShare) -> str:
    if isinstance(share, RankShare):
        return f"tp-{share.rank}-{share.world_size}"
    return f"{share.start}-{share.stop}-{share.is_first:d}{share.is_last:d}"


def _chunked(blocks):
    for block in blocks:
        for start in range(0, len(block), CHUNK_BYTES):
            yield block[start : start + CHUNK_BYTES]
