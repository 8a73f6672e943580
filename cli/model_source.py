"""Which model a command works on: --model (a directory, a GGUF file or a Hugging Face id), or
the demo."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def resolve_model(model: str | Path | None, cache_dir: Path):
    """Inspect `model` (a directory, a GGUF file imported once into `cache_dir`, or ORG/NAME[@REV]
    fetched into or found in the Hugging Face cache), or generate the demo model once into
    `cache_dir` and inspect that."""
    from engines.model.demo import DEMO_BUILD_STEPS, ensure_demo_model
    from engines.model.demo_spec import DemoSpec
    from engines.model.info import inspect_model
    from engines.model.reference import resolve_reference

    from .progress import steps

    if model is None:
        with steps("demo model", DEMO_BUILD_STEPS) as advance:
            path = ensure_demo_model(cache_dir, DemoSpec(), progress=advance)
        log.info("no --model given: using the built-in demo model at %s", path)
        return inspect_model(path)
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
