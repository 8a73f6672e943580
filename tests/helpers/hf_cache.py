"""Lay a model directory out as huggingface_hub's cache does: blobs, snapshots, refs."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

# A made-up but well-formed commit id: the cache keys snapshots by 40 hex digits.
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(
    model: Path, hf_home: Path, repo_id: str, commit: str = COMMIT, ref: str = "main"
) -> Path:
    """Copy `model` into HF_HOME's hub cache as `repo_id` at `commit` (refs/`ref` points there).

    Each file becomes blobs/<sha256> with a relative symlink from snapshots/<commit>/, as
    `hf download` leaves it. Returns the snapshot directory.
    """
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(model.iterdir()):
        if not file.is_file():
            continue
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(file, blob)
        link = snapshot / file.name
        if not link.exists():
            os.symlink(os.path.relpath(blob, snapshot), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot
