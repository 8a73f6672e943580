"""The real SmolLM2-135M-Instruct GGUF for tests: the product's own fetch (engines/model/smollm2.py)
into ~/.cache/tandem/real-models, once; offline afterwards."""

from __future__ import annotations

from pathlib import Path

from discovery.directories import default_cache_dir
from engines.model.smollm2 import fetch_smollm2_gguf, smollm2_gguf_path
from tests.helpers.prefetch import offline, refuse_fetch


def smollm2_gguf(cache_dir: Path | None = None) -> Path:
    """The path of the SmolLM2 GGUF under tandem's cache `cache_dir` (default ~/.cache/tandem).

    A failed download raises: tests that need real weights fail, they do not skip. A test
    worker without network never downloads: it fails in one line naming the fetch command.
    """
    cache_dir = cache_dir or default_cache_dir()
    if offline() and not smollm2_gguf_path(cache_dir).is_file():
        refuse_fetch(f"the SmolLM2 GGUF ({smollm2_gguf_path(cache_dir)})")
    return fetch_smollm2_gguf(cache_dir)
