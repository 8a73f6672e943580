"""Build tandem's CPU kernels once per machine, against the installed mlx wheel.

The extension is compiled with CMake, with mlx's own CMake config and nanobind in the mlx
domain (so an `mx.array` passes straight in), for this machine's CPU (`-march=native`). The
result is kept beside the installation, in `<sys.prefix>/var/tandem-kernels/<key>/` (or
`<cache>/kernels/<key>/` when that is not writable): every process of this install finds it,
whatever its HOME (lab machines and agents have their own). The key hashes the sources, mlx's
and nanobind's versions, the Python and the CPU, so an upgrade or another machine builds anew.
A file lock keeps concurrent processes (tensor-parallel ranks, test workers) to one build.

`python -m engines.kernels.build` builds (the Makefile's install step runs it); a process that
finds no build makes one at first use (about 30 s on 2 cores).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from discovery.directories import default_cache_dir

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = (
    "CMakeLists.txt",
    "affine_matmul.h",
    "affine_matmul.cpp",
    "swiglu.h",
    "swiglu.cpp",
    "thread_pool.h",
    "thread_pool.cpp",
    "bindings.cpp",
)
MODULE_NAME = "_tandem_kernels"
BUILD_TIMEOUT_S = 900


class KernelBuildError(RuntimeError):
    """The kernels could not be built here (no compiler, no CMake, a compile error)."""


def kernel_dir(cache_dir: Path | None = None) -> Path:
    """Where this machine's build of the current sources lives."""
    beside_install = Path(sys.prefix) / "var" / "tandem-kernels"
    if os.access(sys.prefix, os.W_OK) or beside_install.is_dir():
        return beside_install / build_key()
    return (cache_dir or default_cache_dir()) / "kernels" / build_key()


def build_key() -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((SOURCE_DIR / name).read_bytes())
    for package in ("mlx", "nanobind"):
        digest.update(_version(package).encode())
    digest.update(f"{sys.version_info[:2]} {platform.machine()} {_cpu_flags()}".encode())
    return digest.hexdigest()[:16]


def built_module(cache_dir: Path | None = None) -> Path | None:
    """The built extension's file, or None if there is none for these sources yet."""
    found = sorted(kernel_dir(cache_dir).glob(f"{MODULE_NAME}*.so"))
    return found[0] if found else None


def ensure_built(cache_dir: Path | None = None, verbose: bool = False) -> Path:
    """The extension's directory, built first if need be; raises KernelBuildError."""
    target = kernel_dir(cache_dir)
    if built_module(cache_dir) is not None:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it now
        if built_module(cache_dir) is None:
            _build(target, verbose)
    return target


def _build(target: Path, verbose: bool) -> None:
    beside_python = Path(sys.executable).parent / "cmake"  # the cmake wheel, venv not activated
    cmake = str(beside_python) if beside_python.exists() else shutil.which("cmake")
    if cmake is None:
        raise KernelBuildError("cmake is not installed")
    log.info("building tandem's CPU kernels into %s (once per machine)", target)
    with tempfile.TemporaryDirectory(prefix="tandem-kernels-") as scratch:
        commands = (
            [
                cmake,
                "-S",
                str(SOURCE_DIR),
                "-B",
                scratch,
                f"-DPython_EXECUTABLE={sys.executable}",
                "-DCMAKE_BUILD_TYPE=Release",
            ],
            [cmake, "--build", scratch, "-j", str(os.cpu_count() or 1)],
        )
        for command in commands:
            try:
                done = subprocess.run(
                    command, capture_output=not verbose, text=True, timeout=BUILD_TIMEOUT_S
                )
            except (OSError, subprocess.TimeoutExpired) as error:
                raise KernelBuildError(f"{command[1:3]}: {error}") from error
            if done.returncode != 0:
                tail = (done.stderr or done.stdout or "").strip().splitlines()[-3:]
                raise KernelBuildError(f"cmake failed: {' / '.join(tail)}")
        built = sorted(Path(scratch).glob(f"{MODULE_NAME}*.so"))
        if not built:
            raise KernelBuildError(f"cmake made no {MODULE_NAME} module")
        partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        shutil.copy2(built[0], partial / built[0].name)
        partial.rename(target)  # whole or not at all


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = ensure_built(verbose=True)
    except KernelBuildError as error:
        log.error("tandem: cannot build the CPU kernels: %s", error)
        return 1
    log.info("tandem's CPU kernels: %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
