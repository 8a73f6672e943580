"""Which model a command works on: the --model directory, or the built-in demo model."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def resolve_model(model: Path | None, cache_dir: Path):
    """Inspect `model`, or generate the demo model once into `cache_dir` and inspect that."""
    from engines.demo_model import DEMO_BUILD_STEPS, DemoSpec, ensure_demo_model
    from engines.model_info import inspect_model

    from .progress import steps

    if model is None:
        with steps("demo model", DEMO_BUILD_STEPS) as advance:
            model = ensure_demo_model(cache_dir, DemoSpec(), progress=advance)
        log.info("no --model given: using the built-in demo model at %s", model)
    return inspect_model(model)
