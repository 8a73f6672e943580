"""A local Ollama store on disk, written the way Ollama writes one (manifest/layer.go and
server/manifest.go): content-addressed blobs/sha256-<hex> and a schema-2 manifest per name."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
TEMPLATE_MEDIA_TYPE = "application/vnd.ollama.image.template"
PARAMS_MEDIA_TYPE = "application/vnd.ollama.image.params"
SYSTEM_MEDIA_TYPE = "application/vnd.ollama.image.system"
# SmolLM2's template as Ollama's library ships it: Go text/template, which tandem only reads.
TEMPLATE = (
    "{{- if .Messages }}{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n"
    "{{ end }}<|im_start|>assistant\n{{ else }}{{ if .System }}<|im_start|>system\n{{ .System }}"
    "<|im_end|>\n{{ end }}{{ if .Prompt }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n{{ end }}"
    "<|im_start|>assistant\n{{ end }}{{ .Response }}{{ if .Response }}<|im_end|>{{ end }}"
)
PARAMETERS = {"stop": ["<|im_start|>", "<|im_end|>"]}


def add_blob(store: Path, source: Path | bytes) -> dict[str, Any]:
    """Store `source` (a file, hard-linked when it can be, or bytes) as blobs/sha256-<hex>;
    returns its layer entry without the media type."""
    blobs = store / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    if isinstance(source, bytes):
        digest.update(source)
    else:
        with open(source, "rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    blob = blobs / f"sha256-{digest.hexdigest()}"
    if not blob.exists():
        if isinstance(source, bytes):
            blob.write_bytes(source)
        else:
            try:
                os.link(source, blob)
            except OSError:  # another file system
                shutil.copyfile(source, blob)
    return {"digest": f"sha256:{digest.hexdigest()}", "size": blob.stat().st_size}


def write_manifest(
    store: Path, name: str, layers: list[dict[str, Any]], host: str = "registry.ollama.ai"
) -> Path:
    """manifests/HOST/NAMESPACE/MODEL/TAG for `name` ([NAMESPACE/]MODEL:TAG), as Go's
    json.Encoder writes it (compact, one newline), with its config blob."""
    path_part, tag = name.rsplit(":", 1)
    namespace, model = path_part.split("/") if "/" in path_part else ("library", path_part)
    config = {
        "model_format": "gguf",
        "model_family": "llama",
        "model_families": ["llama"],
        "model_type": "134.52M",
        "file_type": "Q4_1",
        "architecture": "amd64",
        "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [layer["digest"] for layer in layers]},
    }
    config_layer = {"mediaType": CONFIG_MEDIA_TYPE, **add_blob(store, _compact(config))}
    document = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": config_layer,
        "layers": layers,
    }
    path = store / "manifests" / host / namespace / model / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_compact(document) + b"\n")
    return path


def write_gguf_entry(store: Path, name: str, gguf: Path) -> Path:
    """An entry as `ollama pull` leaves it: the GGUF, template, params and system layers."""
    layers = [
        {"mediaType": MODEL_MEDIA_TYPE, **add_blob(store, gguf)},
        {"mediaType": TEMPLATE_MEDIA_TYPE, **add_blob(store, TEMPLATE.encode())},
        {"mediaType": SYSTEM_MEDIA_TYPE, **add_blob(store, b"You are a helpful assistant.")},
        {"mediaType": PARAMS_MEDIA_TYPE, **add_blob(store, _compact(PARAMETERS))},
    ]
    return write_manifest(store, name, layers)


def _compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()
