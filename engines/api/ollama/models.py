"""The served model as Ollama's model routes name and describe it: `name:tag`, details and
model_info read from its config.json and weight headers (no weights are read)."""

from __future__ import annotations

import datetime
import functools
import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.api.errors import APIError
from engines.core.service import Service
from engines.core.service_registry import ServiceRegistry
from engines.model.info import FLOAT_DTYPE_BYTES, read_config, read_tensor_table
from errors import ModelError

log = logging.getLogger(__name__)

LATEST = ":latest"  # Ollama's tag for a name given without one
# The Ollama release whose API tandem speaks (thinking, tool calls while streaming, structured
# outputs): clients that check /api/version for a feature find it.
API_VERSION = "0.12.0"
# Without --keep-alive a model stays loaded for as long as it serves: /api/ps says "never".
NEVER = "9999-12-31T23:59:59Z"


def expires_at(service: Service, keep_alive_s: float) -> str:
    """When --keep-alive unloads the model if no request comes (Ollama's /api/ps field)."""
    if keep_alive_s <= 0:
        return NEVER
    left_s = max(0.0, keep_alive_s - (time.monotonic() - service.last_used))
    moment = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=left_s)
    return moment.isoformat().replace("+00:00", "Z")


def listed_name(model_id: str) -> str:
    """The served model as /api/tags lists it: with Ollama's `:latest` unless it has a tag."""
    tail = model_id.rsplit("/", 1)[-1]
    return model_id if ":" in tail else model_id + LATEST


def served_model(models: ServiceRegistry, requested: str, param: str = "model") -> Service:
    """The served model a request's model names (its id or an alias, with or without
    `:latest`); 404 in tandem's words otherwise."""
    found = models.find(requested)
    if found is None and requested.endswith(LATEST):
        found = models.find(requested.removesuffix(LATEST))
    if found is None:
        served = ", ".join(f"'{listed_name(model_id)}'" for model_id in models.ids())
        message = (
            f"model '{requested}' is not served here: this server serves {served} "
            "(--model-alias gives it other names); tandem cannot pull models"
        )
        raise APIError(404, message, param=param, code="model_not_found")
    return found


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What Ollama's model routes say about the served model."""

    family: str = ""
    parameter_count: int = 0
    quantization_level: str = ""
    size: int = 0  # bytes of the weight files
    digest: str = ""  # sha256 of config.json: it changes when the model does
    modified_at: str | None = None  # None (null) before an engine has loaded the model
    info: dict[str, Any] = field(default_factory=dict)  # Ollama's model_info keys

    def details(self) -> dict[str, Any]:
        return {
            "parent_model": "",
            "format": "safetensors",
            "family": self.family,
            "families": [self.family] if self.family else None,
            "parameter_size": parameter_size(self.parameter_count),
            "quantization_level": self.quantization_level,
        }

    def listing(self, name: str) -> dict[str, Any]:
        """The entry of /api/tags (and, with more, of /api/ps)."""
        return {
            "name": name,
            "model": name,
            "modified_at": self.modified_at,
            "size": self.size,
            "digest": self.digest,
            "details": self.details(),
        }


def model_card(service: Service) -> ModelCard:
    """The card of the model the running engine loaded (an empty card before one has)."""
    runner = service.runner
    path = getattr(runner.engine, "model_path", None) if runner is not None else None
    return read_card(str(path)) if path is not None else ModelCard()


@functools.lru_cache(maxsize=4)
def read_card(path: str) -> ModelCard:
    directory = Path(path)
    try:
        config = read_config(directory)
        tensors = read_tensor_table(directory)
        config_bytes = (directory / "config.json").read_bytes()
        modified = (directory / "config.json").stat().st_mtime
    except (ModelError, OSError) as error:
        log.warning("no model details for /api/show: %s", error)
        return ModelCard()
    bits = (config.get("quantization") or {}).get("bits")
    family = str(config.get("model_type", ""))
    parameters = parameter_count(tensors, bits)
    return ModelCard(
        family=family,
        parameter_count=parameters,
        quantization_level=f"Q{bits}" if bits else dominant_dtype(tensors),
        size=sum(size for _, size in tensors.values()),
        digest=hashlib.sha256(config_bytes).hexdigest(),
        modified_at=datetime.datetime.fromtimestamp(modified, datetime.UTC).isoformat(),
        info=model_info(config, family, parameters),
    )


def parameter_count(tensors: dict[str, tuple[str, int]], bits: int | None) -> int:
    """Weights counted from the tensors' sizes; a quantized tensor's packed words hold
    32 / bits weights each, and its scales and biases are not weights."""
    count = 0
    for name, (dtype, size) in tensors.items():
        if dtype in FLOAT_DTYPE_BYTES:
            if bits and name.endswith((".scales", ".biases")):
                continue
            count += size // FLOAT_DTYPE_BYTES[dtype]
        elif dtype == "U32" and bits:
            count += size * 8 // bits
    return count


def dominant_dtype(tensors: dict[str, tuple[str, int]]) -> str:
    """The float type most bytes are stored in (Ollama's "F16", "BF16", "F32")."""
    totals: dict[str, int] = {}
    for dtype, size in tensors.values():
        totals[dtype] = totals.get(dtype, 0) + size
    return max(totals, key=totals.__getitem__, default="")


def parameter_size(count: int) -> str:
    """As Ollama writes it: 8.0B, 494.03M."""
    for scale, suffix, digits in ((1e9, "B", 1), (1e6, "M", 2), (1e3, "K", 2)):
        if count >= scale:
            return f"{count / scale:.{digits}f}{suffix}"
    return str(count)


def model_info(config: dict[str, Any], family: str, parameters: int) -> dict[str, Any]:
    """Ollama's model_info keys, from the config's own (a nested text_config counts)."""
    text = {**config, **(config.get("text_config") or {})}
    keys = {
        "context_length": "max_position_embeddings",
        "block_count": "num_hidden_layers",
        "embedding_length": "hidden_size",
        "feed_forward_length": "intermediate_size",
        "attention.head_count": "num_attention_heads",
        "attention.head_count_kv": "num_key_value_heads",
        "vocab_size": "vocab_size",
    }
    info: dict[str, Any] = {"general.architecture": family, "general.parameter_count": parameters}
    for key, name in keys.items():
        if text.get(name) is not None:
            info[f"{family}.{key}"] = text[name]
    return info
