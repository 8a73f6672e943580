"""An agent's model cache as the planner sees it: free disk and the verified copies it holds.

Reads the manifests engines/weights/fetch.py writes last into each complete copy
(ROOT/CONTENT_HASH/tandem-manifest.json); discovery cannot import engines, so the few
fields it needs are read here.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from pathlib import Path

from discovery.control import HeldModel, ModelCache

log = logging.getLogger(__name__)

MANIFEST_NAME = "tandem-manifest.json"  # engines/weights/manifest.py
# engines/weights/subset.py: StageShare.describe() or RankShare.describe() + " of " + the
# whole model's hash
SHARE_PATTERN = re.compile(r"^layers (\d+)-(\d+)(?: \+ head)? of ([0-9a-f]{64})$")
RANK_PATTERN = re.compile(r"^tp rank (\d+) of (\d+) of ([0-9a-f]{64})$")
REFRESH_S = 5.0


def read_model_cache(root: Path, limit: int | None = None) -> ModelCache:
    """Free bytes where copies land under `root` (within `limit` bytes for everything under
    it, when given), and every complete copy in it."""
    root = Path(root)
    models = []
    for manifest in sorted(root.glob(f"*/{MANIFEST_NAME}")):
        held = _held(manifest)
        if held is not None:
            models.append(held)
    free = _free_bytes(root)
    if limit is not None:
        free = min(free, max(limit - used_bytes(root), 0))
    return ModelCache(free_bytes=free, models=models)


def used_bytes(root: Path) -> int:
    """Bytes of every file under `root` (copies, partial files)."""
    return sum(file.stat().st_size for file in Path(root).rglob("*") if file.is_file())


def _held(manifest: Path) -> HeldModel | None:
    """The copy `manifest` completes, if every file it names is there at its size."""
    try:
        raw = json.loads(manifest.read_text())
        files = [(str(entry["name"]), int(entry["size"])) for entry in raw["files"]]
        subset = str(raw.get("subset", ""))
    except (OSError, ValueError, TypeError, KeyError) as error:
        log.debug("skipping %s: %s", manifest, error)
        return None
    directory = manifest.parent
    for name, size in files:
        file = directory / name
        if ".." in Path(name).parts or not file.is_file() or file.stat().st_size != size:
            return None
    rank = RANK_PATTERN.match(subset)
    if rank is not None:
        number, world, whole = rank.groups()
        return HeldModel(
            content_hash=directory.name, share_of=whole, tp_rank=[int(number), int(world)]
        )
    match = SHARE_PATTERN.match(subset)
    if match is None:
        return HeldModel(content_hash=directory.name) if not subset else None
    first, last, whole = match.groups()
    return HeldModel(
        content_hash=directory.name, share_of=whole, layers=[int(first), int(last) + 1]
    )


def _free_bytes(root: Path) -> int:
    """Free disk of the file system `root` is (or will be) on."""
    path = root
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


class ModelCacheReader:
    """read_model_cache at most every REFRESH_S seconds (heartbeats ask every second)."""

    def __init__(self, root: Path, limit: int | None = None, refresh_s: float = REFRESH_S) -> None:
        self.root = Path(root)
        self.limit = limit
        self.refresh_s = refresh_s
        self._read_at = float("-inf")
        self._latest: ModelCache | None = None

    def latest(self, fresh: bool = False) -> ModelCache:
        now = time.monotonic()
        if fresh or self._latest is None or now - self._read_at >= self.refresh_s:
            self._latest, self._read_at = read_model_cache(self.root, self.limit), now
        return self._latest
