"""Fixtures the GGUF tests share: one directory of demo models and their exports."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="package")
def gguf_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Demo models, their GGUF exports and imports, shared by every GGUF test."""
    return tmp_path_factory.mktemp("gguf")
