"""StageSpec: what the agent tells a stage worker, parsed and checked from its stdin line."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from discovery.cluster_key import KEY_BYTES, KEY_PREFIX, parse_key
from planner.errors import ConfigError
from planner.memory import DEFAULT_QUANTIZED_KV_START, KV_BITS


@dataclass(frozen=True, slots=True)
class StageSpec:
    """What the agent tells a stage worker; it arrives on stdin so the key never hits argv/env."""

    model_path: Path
    layers: range
    is_last: bool
    next_host: str
    next_port: int
    cluster_key: bytes = field(repr=False)
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    read_timeout_s: float = 10.0
    blas_threads: int = 0  # this process's share of the cores; 0 keeps the default
    upcast_float32: bool = False  # half-precision weights to float32 on the CPU
    kv_bits: int = 0  # this stage's KV caches quantized to 8 or 4 bits; 0: as computed
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START  # ... once they hold this many tokens
    # Where to fetch the model when this machine lacks it (engines/weights/fetch.py).
    weights: dict[str, Any] | None = None
    # The prefix cache's disk tier: on when the coordinator gives it a budget (which its
    # index keeps) and this machine a directory (an agent names its own cache's).
    prefix_cache_disk_bytes: int = 0
    prefix_cache_dir: Path | None = None

    @classmethod
    def from_json(cls, line: str | bytes) -> StageSpec:
        """Parse the spec line; ConfigError names the offending field (never the key)."""
        try:
            raw = json.loads(line)
        except (UnicodeDecodeError, ValueError) as error:
            raise ConfigError(f"the stage spec is not JSON: {error}") from None
        if not isinstance(raw, dict):
            raise ConfigError("the stage spec must be a JSON object")
        try:
            start, stop = (int(bound) for bound in raw["layers"])
            spec = cls(
                model_path=Path(str(raw["model_path"])),
                layers=range(start, stop),
                is_last=bool(raw["is_last"]),
                next_host=str(raw["next_host"]),
                next_port=int(raw["next_port"]),
                cluster_key=_parse_cluster_key(raw["cluster_key"]),
                listen_host=str(raw.get("listen_host", "127.0.0.1")),
                listen_port=int(raw.get("listen_port", 0)),
                read_timeout_s=float(raw.get("read_timeout_s", 10.0)),
                blas_threads=int(raw.get("blas_threads", 0)),
                upcast_float32=bool(raw.get("upcast_float32", False)),
                kv_bits=int(raw.get("kv_bits", 0)),
                quantized_kv_start=int(raw.get("quantized_kv_start", DEFAULT_QUANTIZED_KV_START)),
                weights=dict(raw["weights"]) if raw.get("weights") else None,
                prefix_cache_disk_bytes=int(raw.get("prefix_cache_disk_bytes", 0)),
                prefix_cache_dir=_optional_path(raw.get("prefix_cache_dir")),
            )
        except KeyError as error:
            raise ConfigError(f"the stage spec lacks the field {error}") from None
        except (TypeError, ValueError) as error:
            raise ConfigError(f"the stage spec has an invalid field: {error}") from None
        if not 0 <= start < stop:
            raise ConfigError(f"the stage spec's layers [{start}, {stop}) are empty or negative")
        if not (0 <= spec.listen_port < 65536 and 0 < spec.next_port < 65536):
            raise ConfigError(f"invalid ports: listen {spec.listen_port}, next {spec.next_port}")
        if spec.kv_bits not in (0, *KV_BITS):
            raise ConfigError(f"kv_bits must be 0 or one of {KV_BITS}, got {spec.kv_bits}")
        if spec.quantized_kv_start < 0:
            raise ConfigError(
                f"quantized_kv_start must be 0 or more tokens, got {spec.quantized_kv_start}"
            )
        if spec.read_timeout_s <= 0:
            raise ConfigError(f"read_timeout_s must be positive, got {spec.read_timeout_s}")
        return spec


def _optional_path(value: Any) -> Path | None:
    return Path(str(value)) if value else None


def _parse_cluster_key(value: Any) -> bytes:
    text = str(value).strip()
    if text.startswith(KEY_PREFIX):
        return parse_key(text)
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError("cluster_key is neither a 'tandem-...' key nor hex") from None
    if len(key) != KEY_BYTES:
        raise ConfigError(f"cluster_key must be {KEY_BYTES} bytes, got {len(key)}")
    return key
