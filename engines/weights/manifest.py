"""A model directory's files with their sizes and SHA-256, and the content hash naming them."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.model.reference import DOWNLOAD_PATTERNS
from errors import ModelError

log = logging.getLogger(__name__)

MANIFEST_NAME = "tandem-manifest.json"  # written last on an agent: the copy is complete
HASH_BLOCK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class FileEntry:
    name: str  # relative to the model directory, '/'-separated, never '..'
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a complete copy of a model holds; `content_hash` names the copy everywhere."""

    files: tuple[FileEntry, ...]
    subset: str = ""  # "" for a whole model; else which share of which model (a stage's)

    @property
    def content_hash(self) -> str:
        lines = "".join(f"{f.name}\0{f.size}\0{f.sha256}\n" for f in self.files)
        return hashlib.sha256((self.subset + "\n" + lines).encode()).hexdigest()

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    def entry(self, name: str) -> FileEntry:
        for entry in self.files:
            if entry.name == name:
                return entry
        raise ModelError(f"{name!r} is not a file of model {self.content_hash[:12]}")

    def to_json(self) -> str:
        files = [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in self.files]
        return json.dumps({"files": files, "subset": self.subset}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        try:
            raw: Any = json.loads(text)
            files = tuple(
                FileEntry(str(f["name"]), int(f["size"]), str(f["sha256"])) for f in raw["files"]
            )
        except (ValueError, TypeError, KeyError) as error:
            raise ModelError(f"malformed model manifest: {error}") from None
        for entry in files:
            if not _safe_name(entry.name) or entry.size < 0 or len(entry.sha256) != 64:
                raise ModelError(f"model manifest has an unsafe or malformed entry {entry}")
        return cls(tuple(sorted(files, key=lambda f: f.name)), str(raw.get("subset", "")))


def build_manifest(path: Path) -> Manifest:
    """Hash every file mlx-lm needs from `path` (config, weights, tokenizer); reads them all."""
    names = sorted(
        {
            str(file.relative_to(path))
            for pattern in DOWNLOAD_PATTERNS
            for file in path.glob(pattern)
            if file.is_file()
        }
    )
    if not names:
        raise ModelError(f"{path}: no model files to send")
    entries = []
    for name in names:
        file = path / name
        entries.append(FileEntry(name, file.stat().st_size, sha256_of(file)))
    manifest = Manifest(tuple(entries))
    log.info(
        "model %s: %d files, %.1f MB, content hash %s",
        path,
        len(entries),
        manifest.total_bytes / 1e6,
        manifest.content_hash[:12],
    )
    return manifest


def sha256_of(file: Path, limit: int | None = None) -> str:
    """SHA-256 of `file` (of its first `limit` bytes when given)."""
    return hash_prefix(file, limit).hexdigest()


def hash_prefix(file: Path, limit: int | None = None) -> Any:
    """A running sha256 over the first `limit` bytes of `file` (all of it when None)."""
    digest = hashlib.sha256()
    remaining = limit
    with open(file, "rb") as handle:
        while remaining is None or remaining > 0:
            block = handle.read(
                HASH_BLOCK_BYTES if remaining is None else min(HASH_BLOCK_BYTES, remaining)
            )
            if not block:
                break
            digest.update(block)
            if remaining is not None:
                remaining -= len(block)
    return digest


def _safe_name(name: str) -> bool:
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def is_partial_copy(path: Path) -> bool:
    """Whether `path` is a stage's share of a model fetched from a coordinator (not all of it)."""
    try:
        return bool(Manifest.from_json((Path(path) / MANIFEST_NAME).read_text()).subset)
    except (OSError, ModelError):
        return False
