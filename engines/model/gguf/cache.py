"""GGUF files imported once into tandem's cache, keyed by their content's sha256."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path

from engines.model.gguf.importer import Progress, import_gguf, kernel_reads_half_scales
from engines.model.gguf.source import GGUF_MAGIC, SPLIT_PATTERN, check_magic, split_paths
from engines.model.precision import on_cpu

log = logging.getLogger(__name__)

CACHE_FOLDER = "gguf"
DIGESTS_FILE = "digests.json"  # path -> (size, mtime, sha256): a file is hashed once
# Bump when the files an import writes change, so older imports are not served.
IMPORT_VERSION = 3  # 3: float16 scales where tandem's CPU kernel reads them
# Ollama stores each blob under its own digest: sha256-<64 hex>.
OLLAMA_BLOB_PATTERN = re.compile(r"^sha256[-:](?P<digest>[0-9a-f]{64})$")
HASH_CHUNK_BYTES = 16 * 1024**2


def device_key() -> str:
    """What an import depends on besides the file: the device, and on the CPU whether
    tandem's kernel runs (its imports keep float16 scales: importer.kernel_reads_half_scales)."""
    if not on_cpu():
        return "gpu"
    return "cpu-kernel" if kernel_reads_half_scales() else "cpu"


def is_gguf_file(path: Path) -> bool:
    """A regular file that starts with GGUF's magic (Ollama's blobs have no .gguf suffix)."""
    if not path.is_file():
        return False
    with open(path, "rb") as handle:
        return handle.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def ensure_imported(
    path: Path,
    cache_dir: Path,
    name: str | None = None,
    progress: Progress | None = None,
    dequantize: bool = False,
) -> Path:
    """The mlx-lm directory of the GGUF at `path`, imported into `cache_dir` the first time.

    The directory is cache_dir/gguf/<digest and device>/<name>, `name` defaulting to the
    file's stem, so a served model is named after its file. A failed import leaves nothing.
    `dequantize`: float weights (see import_gguf), imported beside the quantized ones.
    """
    path = Path(path).expanduser()
    paths = split_paths(path)
    for part in paths:
        check_magic(part)  # before hashing what is not a GGUF at all
    key = f"{content_digest(paths, cache_dir)[:16]}-{device_key()}"
    key += f"{'-float' if dequantize else ''}-v{IMPORT_VERSION}"
    folder = cache_dir / CACHE_FOLDER / key
    found = imported_directory(folder)
    if found is not None:
        return found
    target = folder / (name or _stem(paths[0]))
    log.info("importing %s into %s", path, target)
    try:
        return import_gguf(path, target, progress, dequantize)
    except BaseException:
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        found = imported_directory(folder)  # another process imported the same file first
        if found is None:
            raise
        return found


def imported_directory(folder: Path) -> Path | None:
    """The complete import under `folder`, if there is one (hidden directories are partial)."""
    if not folder.is_dir():
        return None
    for child in sorted(folder.iterdir()):
        if not child.name.startswith(".") and (child / "config.json").is_file():
            return child
    return None


def content_digest(paths: tuple[Path, ...], cache_dir: Path) -> str:
    """sha256 of the files' bytes (of their digests, for a split GGUF): the name of an Ollama
    blob, else computed once and remembered by path, size and modification time."""
    digests = [_file_digest(path, cache_dir) for path in paths]
    if len(digests) == 1:
        return digests[0]
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def _file_digest(path: Path, cache_dir: Path) -> str:
    if match := OLLAMA_BLOB_PATTERN.match(path.name):
        return match.group("digest")
    stat = path.stat()
    memo_path = cache_dir / CACHE_FOLDER / DIGESTS_FILE
    memo = _read_memo(memo_path)
    identity = str(path.resolve())
    seen = memo.get(identity)
    if seen and seen["size"] == stat.st_size and seen["mtime_ns"] == stat.st_mtime_ns:
        return seen["sha256"]
    log.info("hashing %s (%.1f GB) once, to key its import", path, stat.st_size / 1e9)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    memo[identity] = {
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "sha256": digest.hexdigest(),
    }
    _write_memo(memo_path, memo)
    return digest.hexdigest()


def _read_memo(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _write_memo(path: Path, memo: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(handle, "w", encoding="utf-8") as stream:
        json.dump(memo, stream, indent=1, sort_keys=True)
    os.replace(temporary, path)


def _stem(path: Path) -> str:
    if match := SPLIT_PATTERN.match(path.name):
        return match.group("stem")
    return path.name.removesuffix(".gguf")
