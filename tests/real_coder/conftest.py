"""Fixtures of the Qwen2.5-Coder-0.5B-Instruct tests, once a session: its GGUF (Q5_0, Q8_0, Q4_K,
Q6_K) imported as `tandem serve --model FILE.gguf` imports it, quantized, and mlx-lm's greedy
answers on that import."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engines.model.gguf.cache import ensure_imported
from engines.model.pypi_models import BY_ID, QWEN_CODER_0_5B
from tests.helpers.real_model import Greedy, Question, mlx_lm_greedy
from tests.helpers.real_models import real_gguf

# The suite runs on the 0.5B; TANDEM_TESTS_CODER=qwen2.5-coder-1.5b-instruct runs the same tests
# on the 1.5B by hand (its GGUF is fetched on first use, outside the test workers).
CODER = BY_ID[os.environ.get("TANDEM_TESTS_CODER", QWEN_CODER_0_5B.model_id)]

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
    return ensure_imported(real_gguf(CODER), qwen_cache)


@pytest.fixture(scope="session")
def coder_answers(qwen_dir: Path) -> list[Greedy]:
    """mlx-lm's greedy answers with its quantized layers on tandem's kernel (that the kernel
    gives mlx's own tokens: test_the_cpu_kernel_gives_mlx_quantized_matmul_greedy_tokens)."""
    return mlx_lm_greedy(qwen_dir, CODER_QUESTIONS, packed=True)
