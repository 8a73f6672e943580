"""Fixtures of the Qwen2.5-Coder-0.5B-Instruct tests, once a session: its GGUF (Q5_0, Q8_0, Q4_K,
Q6_K) imported as `tandem serve --model FILE.gguf` imports it, quantized, and mlx-lm's greedy
answers on that import."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.model.gguf.cache import ensure_imported
from tests.helpers.real_model import Greedy, Question, mlx_lm_greedy
from tests.helpers.real_models import qwen_coder_gguf

CODE = Question(
    "Write a Python function add(a, b) that returns a + b. Reply with the code only.",
    "return a + b",
    max_tokens=24,
)
# What mlx-lm answers greedily on the import, checked by hand: "Paris." and a `def add`.
CODER_QUESTIONS = (Question("What is the capital of France?", "Paris"), CODE)


@pytest.fixture(scope="session")
def qwen_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("qwen-coder-cache")


@pytest.fixture(scope="session")
def qwen_dir(qwen_cache: Path) -> Path:
    return ensure_imported(qwen_coder_gguf(), qwen_cache)


@pytest.fixture(scope="session")
def coder_answers(qwen_dir: Path) -> list[Greedy]:
    """mlx-lm's greedy answers with its quantized layers on tandem's kernel (that the kernel
    gives mlx's own tokens: test_the_cpu_kernel_gives_mlx_quantized_matmul_greedy_tokens)."""
    return mlx_lm_greedy(qwen_dir, CODER_QUESTIONS, packed=True)
