"""An mlx-lm model directory written shard by shard: safetensors, their index, config.json."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx

SHARD_BYTES = 2 * 1024**3  # mlx-lm's own converter writes shards of about this size or more
SAFETENSORS_METADATA = {"format": "mlx"}


class ShardWriter:
    """Collects converted arrays and writes model-NNNNN.safetensors files of ~SHARD_BYTES."""

    def __init__(self, directory: Path, shard_bytes: int = SHARD_BYTES) -> None:
        self.directory = directory
        self.shard_bytes = shard_bytes
        self.pending: dict[str, mx.array] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[str, ...]] = []  # the tensor names in each shard

    def add(self, arrays: dict[str, mx.array]) -> None:
        self.pending.update(arrays)
        self.pending_bytes += sum(array.nbytes for array in arrays.values())
        if self.pending_bytes >= self.shard_bytes:
            self._flush()

    def finish(self) -> list[Path]:
        """Write what is pending, name the shards as mlx-lm does, write the index if several."""
        self._flush()
        count = len(self.shards)
        if count == 1:
            final_names = ["model.safetensors"]
        else:
            final_names = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        weight_map: dict[str, str] = {}
        paths = []
        for index, (names, final) in enumerate(zip(self.shards, final_names, strict=True)):
            os.rename(self._provisional(index), self.directory / final)
            weight_map.update({name: final for name in names})
            paths.append(self.directory / final)
        if count > 1:
            total = sum(path.stat().st_size for path in paths)
            index_document = {"metadata": {"total_size": total}, "weight_map": weight_map}
            write_json(self.directory / "model.safetensors.index.json", index_document)
        return paths

    def _provisional(self, index: int) -> Path:
        return self.directory / f".shard-{index:05d}.safetensors"

    def _flush(self) -> None:
        if not self.pending and self.shards:
            return
        index = len(self.shards)
        # mx.save_safetensors insists on the .safetensors suffix, which the name keeps.
        mx.save_safetensors(str(self._provisional(index)), self.pending, SAFETENSORS_METADATA)
        self.shards.append(tuple(self.pending))
        self.pending = {}
        self.pending_bytes = 0


def write_json(path: Path, document: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=2, sort_keys=True)
        handle.write("\n")
