"""A share of a checkpoint: a safetensors file of only the tensors (or slices) a stage or rank runs.

The file is virtual on the coordinator: a header plus byte ranges of the original weight
files, read on demand (no copy on disk), with a SHA-256 computed once by reading it through.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from engines.model.info import EMBEDDING_NAMES, HEAD_NAMES, WEIGHT_GLOB, _read_header
from errors import ModelError

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
class RankShare:
    """Which tp rank a share is for."""

    rank: int
    world_size: int

    def describe(self) -> str:
        return f"tp rank {self.rank} of {self.world_size}"


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
    return subset_file(model_path, share.wants, {}, share.describe())


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """The part of one tensor a tp rank keeps: `ranges` of indices along `axis`, in order."""

    axis: int  # non-negative
    ranges: tuple[tuple[int, int], ...]

    def length(self) -> int:
        return sum(stop - start for start, stop in self.ranges)


def subset_file(
    model_path: Path,
    wants: Callable[[str], bool],
    slices: Mapping[str, TensorSlice],
    what: str,
    metadata: Mapping[str, str] | None = None,
) -> VirtualFile:
    """A safetensors file of the tensors `wants` keeps, in name order; a tensor named in
    `slices` holds only that slice (byte ranges of the original, row-major)."""
    entries: list[tuple[str, dict, Path, int]] = []  # name, header entry, file, data start
    table_metadata: dict = {}
    for file in sorted(Path(model_path).glob(WEIGHT_GLOB)):
        header = _read_header(file)
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
        table_metadata = table_metadata or dict(header.get("__metadata__") or {})
        for name, entry in header.items():
            if name != "__metadata__" and wants(name):
                entries.append((name, entry, file, 8 + length))
    if not entries:
        raise ModelError(f"{model_path}: no tensors for {what}")
    entries.sort(key=lambda item: item[0])
    table_metadata.update(metadata or {})
    table: dict = {"__metadata__": table_metadata} if table_metadata else {}
    segments: list[_Segment] = []
    offset = 0
    for name, entry, file, data_start in entries:
        begin, end = (int(bound) for bound in entry["data_offsets"])
        shape = [int(size) for size in entry["shape"]]
        pieces = [(data_start + begin, end - begin)]
        if name in slices:
            shape, pieces = _slice(name, shape, end - begin, data_start + begin, slices[name])
        size = sum(piece[1] for piece in pieces)
        table[name] = {
            "dtype": entry["dtype"],
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        segments.extend(_Segment(file, start, length) for start, length in pieces)
        offset += size
    header = json.dumps(table, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return VirtualFile(struct.pack("<Q", len(header)) + header, segments)


def _slice(
    name: str, shape: list[int], nbytes: int, start: int, part: TensorSlice
) -> tuple[list[int], list[tuple[int, int]]]:
    """The sliced shape and the (start, length) byte ranges holding `part` of a tensor."""
    if not 0 <= part.axis < len(shape) or any(
        not 0 <= low < high <= shape[part.axis] for low, high in part.ranges
    ):
        raise ModelError(f"slice {part} does not fit tensor {name} of shape {shape}")
    elements = math.prod(shape)
    item = nbytes // elements if elements else 0
    inner = math.prod(shape[part.axis + 1 :]) * item  # bytes of one index along the axis
    stride = shape[part.axis] * inner
    pieces: list[tuple[int, int]] = []
    for outer in range(math.prod(shape[: part.axis])):
        for low, high in part.ranges:
            begin, length = start + outer * stride + low * inner, (high - low) * inner
            if pieces and pieces[-1][0] + pieces[-1][1] == begin:
                pieces[-1] = (pieces[-1][0], pieces[-1][1] + length)  # contiguous: merge
            else:
                pieces.append((begin, length))
    sliced = list(shape)
    sliced[part.axis] = part.length()
    return sliced, pieces
