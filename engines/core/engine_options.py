"""EngineOptions: how an engine runs, as one value that crosses every process boundary whole.

`tandem serve` fills it from its flags (cli/serve.py), the launcher sets what the plan decided
(engines/cluster/launch.py), and every engine, tp rank and pipeline stage reads its own
fields from it. A new option is a field here, its flag, and its use: nothing in between
names it. No mlx here: the CLI builds one before any engine loads.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from engines.core.engine import DEFAULT_PREFILL_CHUNK
from errors import ConfigError
from planner.memory import DEFAULT_MAX_BATCH, DEFAULT_QUANTIZED_KV_START, KV_BITS


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Every choice an engine is built with; plain JSON values, checked once on creation."""

    # Sequences decoded together (continuous batching): --max-batch, or what the plan fits.
    max_batch: int = DEFAULT_MAX_BATCH
    # Prompt tokens per forward pass: a long prompt delays the batch one chunk at a time.
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    # Half-precision weights computed in float32 on the CPU (the plan counted the memory).
    upcast: bool = False
    # The prefix cache's memory budget over the whole model, from the plan; 0 keeps none.
    prefix_cache_bytes: int = 0
    # --prefix-cache-disk-bytes: the prefix cache's disk tier; 0: none.
    prefix_cache_disk_bytes: int = 0
    # This machine's root for the disk tier (each engine or share keeps a folder under it);
    # an agent puts its own cache's in the specs it is handed.
    prefix_cache_dir: str | None = None
    # --kv-bits: every engine's KV cache quantized to 8 or 4 bits; 0: as computed.
    kv_bits: int = 0
    # --quantized-kv-start: ... once a sequence holds this many tokens.
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    # --num-draft-tokens: tokens a lone sequence drafts per step (speculation); 0: off.
    most_drafted: int = 0
    # --draft-model resolved: draft from this model instead of by prompt lookup (single only).
    draft_model_path: str | None = None
    # BLAS threads of this process: --blas-threads, or its share of a machine that several
    # members share; 0 keeps the machine's default (TANDEM_BLAS_THREADS, else every core).
    blas_threads: int = 0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not _has_type(value, field.type):
                raise ConfigError(f"engine option {field.name} must be {field.type}, got {value!r}")
        if self.max_batch < 1 or self.prefill_chunk < 1:
            raise ConfigError(
                f"max_batch and prefill_chunk must be at least 1, got {self.max_batch} and "
                f"{self.prefill_chunk}"
            )
        if self.kv_bits not in (0, *KV_BITS):
            raise ConfigError(f"kv_bits must be 0 or one of {KV_BITS}, got {self.kv_bits}")
        negative = [
            name
            for name in (
                "quantized_kv_start",
                "most_drafted",
                "prefix_cache_bytes",
                "prefix_cache_disk_bytes",
                "blas_threads",
            )  # fmt: skip
            if getattr(self, name) < 0
        ]
        if negative:
            raise ConfigError(f"{negative[0]} must be 0 or more, got {getattr(self, negative[0])}")

    def document(self) -> dict[str, Any]:
        """The options as a JSON object: the one form in which they cross a process boundary."""
        return {field.name: getattr(self, field.name) for field in fields(self)}

    @classmethod
    def from_document(cls, document: Any) -> EngineOptions:
        """The options a `document()` describes; ConfigError names a field that is unknown or
        invalid. A field left out takes its default."""
        if not isinstance(document, dict):
            raise ConfigError(f"engine options must be a JSON object, got {document!r}")
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(document) - known)
        if unknown:
            raise ConfigError(f"unknown engine options: {unknown}")
        return cls(**document)


_TYPES = {"int": int, "bool": bool, "str | None": (str, type(None))}


def _has_type(value: Any, annotation: str) -> bool:
    """Whether `value` is of a field's annotation (a string, under postponed annotations);
    a bool is not taken for an int, as JSON keeps them apart."""
    expected = _TYPES[annotation]
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


DEFAULT_OPTIONS = EngineOptions()  # every option at its default: what tests and tools start from
