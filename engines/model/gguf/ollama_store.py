"""Models in Ollama's local store (`--model ollama:NAME[:TAG]`): a manifest names the GGUF blob."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from errors import ModelError

log = logging.getLogger(__name__)

PREFIX = "ollama:"
DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
# Ollama's next layout (manifests-v2, symlinks to manifest blobs) files public names under this.
CANONICAL_HOST = "ollama.com"
MANIFEST_FOLDERS = ("manifests-v2", "manifests")  # newer first, as Ollama resolves them
BLOBS_FOLDER = "blobs"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
MANIFEST_LIST_MEDIA_TYPE = "application/vnd.ollama.manifest.list.v2+json"
# Small layers kept for information; the GGUF's own chat template is what tandem applies.
TEXT_LAYERS = {
    "application/vnd.ollama.image.template": "template",
    "application/vnd.ollama.image.system": "system",
    "application/vnd.ollama.image.params": "parameters",
}
TEXT_LAYER_MAX_BYTES = 1024**2
DIGEST_PATTERN = re.compile(r"^sha256:(?P<hex>[0-9a-f]{64})$")
# Ollama's name parts: letters, digits, '_', '-', '.' (no '.' in a namespace, never '..').
PART_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
SHOWN_NAMES = 20  # in the error for a missing name


@dataclass(frozen=True, slots=True)
class OllamaName:
    """A model's place in the store: host/namespace/model:tag, as Ollama files its manifest."""

    host: str
    namespace: str
    model: str
    tag: str

    def __str__(self) -> str:
        """The shortest spelling Ollama shows: the default host and namespace left out."""
        prefix = "" if self.host == DEFAULT_HOST else f"{self.host}/"
        if prefix or self.namespace != DEFAULT_NAMESPACE:
            prefix += f"{self.namespace}/"
        return f"{prefix}{self.model}:{self.tag}"

    def manifest_paths(self, store: Path) -> list[Path]:
        """Where the manifest may be, in the order Ollama looks (v2 first, public host aliases)."""
        hosts = [self.host]
        if self.host.lower() in (DEFAULT_HOST, CANONICAL_HOST):
            hosts = [CANONICAL_HOST, DEFAULT_HOST]
        return [
            store / folder / host / self.namespace / self.model / self.tag
            for folder in MANIFEST_FOLDERS
            for host in hosts
        ]


@dataclass(frozen=True, slots=True)
class OllamaModel:
    """A store entry: its GGUF blob (named by its sha256) and what its small layers say."""

    name: OllamaName
    manifest: Path
    gguf: Path
    digest: str  # the blob's sha256, hex: the key tandem's import cache files it under
    size: int
    texts: dict[str, str] = field(default_factory=dict)  # template, system, parameters

    @property
    def directory_name(self) -> str:
        """A file-system-safe name for its import (and the served model id): NAME-TAG."""
        return f"{self.name.model}-{self.name.tag}"


def is_ollama_reference(text: str | Path) -> bool:
    return isinstance(text, str) and text.startswith(PREFIX)


def parse_name(text: str) -> OllamaName:
    """`ollama:[[HOST/]NAMESPACE/]MODEL[:TAG]` -> its parts, Ollama's defaults filled in."""
    spelled = text.removeprefix(PREFIX).strip()
    path, _, tag = spelled.rpartition(":") if ":" in spelled else (spelled, "", DEFAULT_TAG)
    parts = path.split("/")
    if len(parts) > 3 or not all(PART_PATTERN.match(part) and ".." not in part for part in parts):
        raise ModelError(
            f"--model {text}: not an Ollama model name; spell it ollama:NAME[:TAG] "
            f"(e.g. ollama:llama3.2:1b) or ollama:NAMESPACE/NAME[:TAG]"
        )
    if not PART_PATTERN.match(tag) or ".." in tag:
        raise ModelError(f"--model {text}: {tag!r} is not an Ollama tag")
    host, namespace = DEFAULT_HOST, DEFAULT_NAMESPACE
    if len(parts) == 3:
        host, namespace = parts[0], parts[1]
    elif len(parts) == 2:
        namespace = parts[0]
    if "." in namespace:
        raise ModelError(f"--model {text}: an Ollama namespace has no '.', got {namespace!r}")
    return OllamaName(host, namespace, parts[-1], tag)


def find_model(text: str, store: Path) -> OllamaModel:
    """The entry `text` names in the store at `store`; a ModelError in one line when it is not
    there (naming the store and the names it has) or its manifest or blob is unusable."""
    name = parse_name(text)
    manifest = _find_manifest(name, store)
    if manifest is None:
        raise ModelError(f"{PREFIX}{name} is not in the Ollama store at {store}: {_have(store)}")
    document = _read_manifest(manifest)
    layers = document.get("layers")
    if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
        raise ModelError(f"{manifest}: an Ollama manifest needs a list of layers")
    models = [layer for layer in layers if layer.get("mediaType") == MODEL_MEDIA_TYPE]
    if len(models) != 1:
        kinds = sorted({str(layer.get("mediaType")) for layer in layers})
        raise ModelError(
            f"{PREFIX}{name}: its manifest {manifest} has {len(models)} GGUF layers "
            f"({MODEL_MEDIA_TYPE}), tandem needs exactly one; its layers: {', '.join(kinds)}"
        )
    digest = _digest(models[0], manifest)
    gguf = store / BLOBS_FOLDER / f"sha256-{digest}"
    _check_blob(gguf, models[0].get("size"), name)
    texts = {
        TEXT_LAYERS[layer["mediaType"]]: _read_text(store, layer, manifest)
        for layer in layers
        if layer.get("mediaType") in TEXT_LAYERS
    }
    log.info("%s%s: GGUF blob %s (%d bytes)", PREFIX, name, gguf, gguf.stat().st_size)
    return OllamaModel(name, manifest, gguf, digest, gguf.stat().st_size, texts)


def list_names(store: Path) -> list[str]:
    """Every name the store holds, as Ollama shows them, sorted."""
    names: set[str] = set()
    for folder in MANIFEST_FOLDERS:
        root = store / folder
        for manifest in root.glob("*/*/*/*"):
            if manifest.is_dir():
                continue
            host, namespace, model, tag = manifest.relative_to(root).parts
            if host == CANONICAL_HOST:
                host = DEFAULT_HOST
            names.add(str(OllamaName(host, namespace, model, tag)))
    return sorted(names)


def _find_manifest(name: OllamaName, store: Path) -> Path | None:
    for path in name.manifest_paths(store):
        if path.is_file():
            return path
    # Ollama's names are case-insensitive; its files keep the case they were pulled with.
    wanted = str(name).lower()
    for folder in MANIFEST_FOLDERS:
        root = store / folder
        for path in root.glob("*/*/*/*"):
            host, namespace, model, tag = path.relative_to(root).parts
            host = DEFAULT_HOST if host.lower() == CANONICAL_HOST else host
            if path.is_file() and str(OllamaName(host, namespace, model, tag)).lower() == wanted:
                return path
    return None


def _have(store: Path) -> str:
    if not store.is_dir():
        return "no such directory (set OLLAMA_MODELS to the store's models folder)"
    names = list_names(store)
    if not names:
        return "it holds no models"
    shown = ", ".join(names[:SHOWN_NAMES])
    more = f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else ""
    return f"it holds {shown}{more}"


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ModelError(f"{path}: unreadable Ollama manifest ({error})") from None
    if not isinstance(document, dict):
        raise ModelError(f"{path}: an Ollama manifest is a JSON object")
    if document.get("mediaType") == MANIFEST_LIST_MEDIA_TYPE:
        raise ModelError(
            f"{path}: a manifest list (one model for several runners); tandem reads single "
            f"GGUF manifests only"
        )
    return document


def _digest(layer: dict[str, Any], manifest: Path) -> str:
    match = DIGEST_PATTERN.match(str(layer.get("digest", "")).lower())
    if match is None:
        raise ModelError(f"{manifest}: layer digest {layer.get('digest')!r} is not sha256:<hex>")
    return match.group("hex")


def _check_blob(path: Path, size: Any, name: OllamaName) -> None:
    if not path.is_file():
        raise ModelError(
            f"{PREFIX}{name}: its GGUF blob {path} is missing (a pull that did not finish? "
            f"run `ollama pull {name}`)"
        )
    actual = path.stat().st_size
    if isinstance(size, int) and actual != size:
        raise ModelError(
            f"{PREFIX}{name}: its GGUF blob {path} has {actual} bytes, its manifest says {size} "
            f"(run `ollama pull {name}` again)"
        )


def _read_text(store: Path, layer: dict[str, Any], manifest: Path) -> str:
    path = store / BLOBS_FOLDER / f"sha256-{_digest(layer, manifest)}"
    try:
        if path.stat().st_size > TEXT_LAYER_MAX_BYTES:
            return ""
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""  # for information only: a missing template does not stop the model
