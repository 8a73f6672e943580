"""Tiny deterministic demo models for tests, written once under a directory and reused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.model.demo import ensure_demo_model
from engines.model.demo_spec import DemoSpec


def make_demo_model(tmp_path: Path, **overrides: Any) -> Path:
    """A demo model for DemoSpec(**overrides) under `tmp_path`, reused if already there."""
    return ensure_demo_model(Path(tmp_path), DemoSpec(**overrides))
