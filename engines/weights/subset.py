"""One pipeline stage's share of a checkpoint: a safetensors file of only the tensors it runs.

The file is virtual on the coordinator: a header plus byte ranges of the original weight
files, read on demand (no copy on disk), with a SHA-256 computed once by reading it through.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from engines.model.info import EMBEDDING_NAMES, HEAD_NAMES, WEIGHT_GLOB, _read_header
from planner.errors import ModelError

LAYER_PATTERN = re.compile(r"\.layers\.(\d+)\.")
SUBSET_FILE = "model.safetensors"
BLOCK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class StageShare:
    """Which part of the model a stage runs."""

    start: int
    stop: int
    is_first: bool
    is_last: bool
    tied: bool

    def wants(self, name: str) -> bool:
        """Whether tensor `name` belongs to this stage."""
        match = LAYER_PATTERN.search(f".{name}")
        if match is not None:
            return self.start <= int(match.group(1)) < self.stop
        parts = set(name.split("."))
        if parts & EMBEDDING_NAMES:
            return self.is_first or (self.is_last and self.tied)
        if parts & HEAD_NAMES:
            return self.is_last
        return True  # the final norm and anything small outside the layers

    def describe(self) -> str:
        return f"layers {self.start}-{self.stop - 1}" + (" + head" if self.is_last else "")


@dataclass(frozen=True, slots=True)
class _Segment:
    file: Path
    start: int  # absolute offset in `file`
    length: int


class VirtualFile:
    """Bytes assembled from a header and segments of other files; read-only, seekable."""

    def __init__(self, header: bytes, segments: list[_Segment]) -> None:
        self._header = header
        self._segments = segments
        self.size = len(header) + sum(segment.length for segment in segments)

    def blocks(self, offset: int = 0):
        """The bytes from `offset` to the end, in blocks of at most BLOCK_BYTES."""
        position = 0
        if offset < len(self._header):
            yield self._header[offset:]
        position = len(self._header)
        handles: dict[Path, BinaryIO] = {}
        try:
            for segment in self._segments:
                end = position + segment.length
                if end > offset:
                    skip = max(0, offset - position)
                    handle = handles.get(segment.file)
                    if handle is None:
                        handle = handles[segment.file] = open(segment.file, "rb")
                    handle.seek(segment.start + skip)
                    remaining = segment.length - skip
                    while remaining > 0:
                        block = handle.read(min(BLOCK_BYTES, remaining))
                        if not block:
                            raise ModelError(f"{segment.file} is shorter than its header says")
                        remaining -= len(block)
                        yield block
                position = end
        finally:
            for handle in handles.values():
                handle.close()

    def sha256(self) -> str:
        digest = hashlib.sha256()
        for block in self.blocks():
            digest.update(block)
        return digest.hexdigest()


def stage_file(model_path: Path, share: StageShare) -> VirtualFile:
    """A safetensors file holding exactly the tensors of `share`, in name order."""
    entries: list[tuple[str, dict, Path, int]] = []  # name, header entry, file, data start
    metadata: dict = {}
    for file in sorted(Path(model_path).glob(WEIGHT_GLOB)):
        header = _read_header(file)
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
        metadata = metadata or dict(header.get("__metadata__") or {})
        for name, entry in header.items():
            if name != "__metadata__" and share.wants(name):
                entries.append((name, entry, file, 8 + length))
    if not entries:
        raise ModelError(f"{model_path}: no tensors for {share.describe()}")
    entries.sort(key=lambda item: item[0])
    table: dict = {"__metadata__": metadata} if metadata else {}
    segments: list[_Segment] = []
    offset = 0
    for name, entry, file, data_start in entries:
        begin, end = (int(bound) for bound in entry["data_offsets"])
        table[name] = {
            "dtype": entry["dtype"],
            "shape": entry["shape"],
            "data_offsets": [offset, offset + end - begin],
        }
        segments.append(_Segment(file, data_start + begin, end - begin))
        offset += end - begin
    header = json.dumps(table, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return VirtualFile(struct.pack("<Q", len(header)) + header, segments)
