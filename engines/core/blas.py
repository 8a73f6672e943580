"""An optimized BLAS under mlx on Linux: loaded before mlx, so mlx's own BLAS calls bind to it.

The Linux `mlx[cpu]` wheels link the reference (Netlib) BLAS: a float32 matmul runs ~20x and a
prefill ~10x slower than it needs to. A library loaded first with RTLD_GLOBAL wins the symbol
lookup for `cblas_*`, so mlx calls it instead. This module must not import mlx: it runs from
`engines/__init__.py`, before anything under engines/ can.

Candidates, first that loads wins (docs/operations.md says why): Intel's MKL (`libmkl_rt`, the
`mkl` wheel), then OpenBLAS from the `cmeel-openblas` wheel (it needs the system's
libgfortran5). `TANDEM_BLAS=reference` keeps mlx's own; `TANDEM_BLAS_THREADS` sizes the pool.
They, and the switches of the products tandem computes itself (`TANDEM_GEMM_LAYOUT`,
`TANDEM_CPU_KERNELS`), are environment variables because they must cross into every worker
process before its first mlx import; the CLI's `--blas`, `--blas-threads`, `--gemm-layout` and
`--cpu-kernels` flags set them.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BLAS_ENV = "TANDEM_BLAS"  # "auto" (default) or "reference"
THREADS_ENV = "TANDEM_BLAS_THREADS"  # a positive integer; default: every core
LAYOUT_ENV = "TANDEM_GEMM_LAYOUT"  # "auto" (default) or "off" (engines/model/gemm_layout.py)
KERNELS_ENV = "TANDEM_CPU_KERNELS"  # "auto" (default) or "off" (engines/kernels)
CHOICES = ("auto", "reference")
MKL_INTEL, MKL_SEQUENTIAL = 0, 1  # MKL_Set_Threading_Layer values


@dataclass(frozen=True, slots=True)
class BlasStatus:
    """Which BLAS mlx calls in this process, and why."""

    name: str  # "mkl", "openblas" or "reference"
    threads: int
    path: str = ""
    note: str = ""  # why the reference BLAS is in use, when it is

    def describe(self) -> str:
        if self.name == "reference":
            return f"reference BLAS (mlx as installed): {self.note}"
        return f"{self.name} ({self.path}), {self.threads} thread(s), bound for mlx's cblas calls"


_status: BlasStatus | None = None


def activate() -> BlasStatus:
    """Load the optimized BLAS once per process (Linux only); never raises."""
    global _status
    if _status is not None:
        return _status
    choice = os.environ.get(BLAS_ENV, "auto").strip().lower() or "auto"
    if sys.platform != "linux":
        _status = BlasStatus("reference", 0, note="not Linux: mlx brings its own BLAS here")
    elif choice not in CHOICES:
        _status = _reference(f"{BLAS_ENV}={choice!r} is not one of {CHOICES}", warn=True)
    elif choice == "reference":
        _status = BlasStatus("reference", 0, note=f"turned off ({BLAS_ENV}=reference)")
    elif "mlx.core" in sys.modules:
        _status = _reference("mlx was imported before tandem's engines", warn=True)
    else:
        _status = _load_first_available(_thread_count())
    return _status


def status() -> BlasStatus:
    return activate()


def weights_first_allowed() -> bool:
    """Whether Linear layers may be computed weights first (engines/model/gemm_layout.py):
    what that avoids is MKL's packing, and TANDEM_GEMM_LAYOUT=off (--gemm-layout) says no."""
    return status().name == "mkl" and os.environ.get(LAYOUT_ENV, "").strip().lower() != "off"


def cpu_kernels_choice() -> str:
    """"auto" or "off" for tandem's CPU kernels (engines/kernels), as --cpu-kernels set it;
    anything else is returned as given, for the caller to refuse."""
    return os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"


def set_threads(threads: int) -> BlasStatus:
    """Resize the BLAS thread pool (a worker learns its share from its spec)."""
    global _status
    current = activate()
    if current.name == "reference" or threads < 1 or threads == current.threads:
        return current
    library = ctypes.CDLL(current.path, mode=ctypes.RTLD_GLOBAL)  # already loaded: same handle
    _apply_threads(current.name, library, threads)
    _status = BlasStatus(current.name, threads, current.path)
    return _status


def _thread_count() -> int:
    raw = os.environ.get(THREADS_ENV, "")
    try:
        threads = int(raw) if raw else 0
    except ValueError:
        threads = 0
        log.warning("ignoring %s=%r: not an integer", THREADS_ENV, raw)
    return threads if threads > 0 else (os.cpu_count() or 1)


def _load_first_available(threads: int) -> BlasStatus:
    problems = []
    for name, path in _candidates():
        try:
            library = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            _apply_threads(name, library, threads)
        except (OSError, AttributeError) as error:
            problems.append(f"{name}: {error}")
            continue
        bound_to = _library_providing("cblas_sgemm")
        if bound_to is None or Path(bound_to).resolve() != path.resolve():
            problems.append(f"{name} loaded but cblas_sgemm resolves to {bound_to}")
            continue
        return BlasStatus(name, threads, str(path))
    return _reference("; ".join(problems) or "no optimized BLAS package installed", warn=True)


def _candidates() -> list[tuple[str, Path]]:
    """(name, library path) of every installed candidate, in order of preference."""
    found = []
    for name, package, filename in (
        ("mkl", "mkl", "libmkl_rt.so.3"),
        ("openblas", "cmeel-openblas", "libopenblas.so.0"),
    ):
        try:
            files = importlib.metadata.files(package) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for file in files:
            if file.name == filename:
                found.append((name, Path(str(file.locate())).resolve()))
                break
    return found


def _apply_threads(name: str, library: ctypes.CDLL, threads: int) -> None:
    if name == "mkl":
        # One thread: the sequential layer needs no OpenMP runtime; more: Intel's OpenMP,
        # which the mkl wheel brings along (intel-openmp).
        library.MKL_Set_Threading_Layer(MKL_SEQUENTIAL if threads == 1 else MKL_INTEL)
        library.MKL_Set_Num_Threads(threads)
    else:
        library.openblas_set_num_threads(threads)


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _library_providing(symbol: str) -> str | None:
    """The file whose `symbol` a library loaded now would bind to (the global scope's)."""
    process = ctypes.CDLL(None)
    try:
        address = ctypes.cast(getattr(process, symbol), ctypes.c_void_p).value
    except AttributeError:
        return None
    info = _DlInfo()
    if not process.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return None
    return info.dli_fname.decode()


def _reference(reason: str, warn: bool) -> BlasStatus:
    if warn:
        log.warning("using mlx's reference BLAS (slow on the CPU): %s", reason)
    return BlasStatus("reference", 0, note=reason)
