"""A GGUF model on disk: its file or split files, read with gguf-py, checked, tensors by name."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderTensor

from errors import ModelError

GGUF_MAGIC = b"GGUF"
# llama.cpp's gguf-split names its parts NAME-00001-of-00003.gguf.
SPLIT_PATTERN = re.compile(r"^(?P<stem>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_COUNT_KEY = "split.count"
ARCHITECTURE_KEY = "general.architecture"


class MappedReader(GGUFReader):
    """gguf-py's reader over a plain array view of its memory map: numpy's memmap runs Python
    hooks on every slice, ~80% of the time to read a vocabulary of 50k strings."""

    def _get(self, offset, dtype, count=1, override_order=None):  # noqa: ANN001, ANN202
        if type(self.data) is not np.ndarray:
            self.data = self.data.view(np.ndarray)  # the same mapped bytes
        return super()._get(offset, dtype, count, override_order)


@dataclass(frozen=True, slots=True)
class GGUFSource:
    """The readers of one model's GGUF files (the first holds the metadata) and its tensors."""

    paths: tuple[Path, ...]
    readers: tuple[GGUFReader, ...]
    tensors: dict[str, ReaderTensor]

    @property
    def metadata(self) -> GGUFReader:
        return self.readers[0]

    @property
    def architecture(self) -> str:
        return str(self.value(ARCHITECTURE_KEY))

    @property
    def total_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.paths)

    def has(self, key: str) -> bool:
        return key in self.metadata.fields

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value (a number, string, or list), `default` when absent; no default and
        absent is a ModelError naming the key."""
        field = self.metadata.fields.get(key)
        if field is None:
            if default is None:
                raise ModelError(f"{self.paths[0]}: the GGUF metadata has no {key!r}")
            return default
        return field.contents()

    def array(self, key: str) -> np.ndarray | None:
        """A numeric array field as numpy (no Python list of a 150k-entry vocabulary)."""
        field = self.metadata.fields.get(key)
        if field is None:
            return None
        if field.types[-1] == GGUFValueType.STRING:
            raise ModelError(f"{self.paths[0]}: {key!r} holds strings, not numbers")
        return np.concatenate([field.parts[index] for index in field.data])


def split_paths(path: Path) -> tuple[Path, ...]:
    """Every part of a split GGUF given any one of them (in order), or just `path`."""
    match = SPLIT_PATTERN.match(path.name)
    if match is None:
        return (path,)
    count = int(match.group("count"))
    width = len(match.group("number"))
    stem = match.group("stem")
    parts = tuple(
        path.with_name(f"{stem}-{number:0{width}d}-of-{count:0{width}d}.gguf")
        for number in range(1, count + 1)
    )
    missing = [part.name for part in parts if not part.is_file()]
    if missing:
        raise ModelError(f"{path}: split GGUF is missing {', '.join(missing)} beside it")
    return parts


def open_source(path: Path) -> GGUFSource:
    """Open `path` (a GGUF file or one part of a split one); a ModelError in one line when it
    is not a complete GGUF."""
    paths = split_paths(Path(path))
    readers = tuple(_open_reader(part) for part in paths)
    declared = readers[0].fields.get(SPLIT_COUNT_KEY)
    if declared is not None and int(declared.contents()) != len(paths):
        raise ModelError(
            f"{path}: the GGUF says it is split in {declared.contents()} files; name the parts "
            f"NAME-00001-of-{int(declared.contents()):05d}.gguf and pass the first"
        )
    tensors: dict[str, ReaderTensor] = {}
    for part, reader in zip(paths, readers, strict=True):
        for tensor in reader.tensors:
            if tensor.name in tensors:
                raise ModelError(f"{part}: tensor {tensor.name} is in two parts of the split")
            tensors[tensor.name] = tensor
    if ARCHITECTURE_KEY not in readers[0].fields:
        raise ModelError(f"{paths[0]}: the GGUF metadata has no {ARCHITECTURE_KEY!r}")
    return GGUFSource(paths=paths, readers=readers, tensors=tensors)


def check_magic(path: Path) -> None:
    """A ModelError unless `path` is a file that starts with GGUF's magic."""
    if not path.is_file():
        raise ModelError(f"{path}: no such GGUF file")
    with open(path, "rb") as handle:
        magic = handle.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ModelError(f"{path}: not a GGUF file (starts with {magic!r}, not {GGUF_MAGIC!r})")


def _open_reader(path: Path) -> GGUFReader:
    check_magic(path)
    size = path.stat().st_size
    try:
        reader = MappedReader(path)
    except (ValueError, IndexError, KeyError, OverflowError) as error:
        raise ModelError(f"{path}: truncated or corrupt GGUF ({error})") from None
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise ModelError(
                f"{path}: truncated GGUF: tensor {tensor.name} ends at byte "
                f"{tensor.data_offset + tensor.n_bytes}, the file has {size}"
            )
    return reader
