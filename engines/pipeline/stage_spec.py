"""StageSpec: what the agent tells a stage worker, parsed and checked from its stdin line."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from discovery.cluster_key import KEY_BYTES, KEY_PREFIX, parse_key
from engines.core.engine_options import EngineOptions
from errors import ConfigError


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
    # How the stage runs; its disk tier is on when the coordinator gives it a budget (which
    # its index keeps) and this machine a prefix_cache_dir (an agent names its own cache's).
    options: EngineOptions = EngineOptions()
    # Where to fetch the model when this machine lacks it (engines/weights/fetch.py).
    weights: dict[str, Any] | None = None

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
                options=EngineOptions.from_document(raw.get("options", {})),
                weights=dict(raw["weights"]) if raw.get("weights") else None,
            )
        except KeyError as error:
            raise ConfigError(f"the stage spec lacks the field {error}") from None
        except (TypeError, ValueError) as error:
            raise ConfigError(f"the stage spec has an invalid field: {error}") from None
        if not 0 <= start < stop:
            raise ConfigError(f"the stage spec's layers [{start}, {stop}) are empty or negative")
        if not (0 <= spec.listen_port < 65536 and 0 < spec.next_port < 65536):
            raise ConfigError(f"invalid ports: listen {spec.listen_port}, next {spec.next_port}")
        if spec.read_timeout_s <= 0:
            raise ConfigError(f"read_timeout_s must be positive, got {spec.read_timeout_s}")
        return spec


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
