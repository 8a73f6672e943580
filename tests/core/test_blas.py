"""The optimized BLAS under mlx: loaded first, bound for mlx's calls, off switch, fallback."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engines.core import blas

PROJECT_ROOT = Path(__file__).resolve().parents[2]
REPORT = """
import json, time, sys
{before}
import engines
from engines import blas
import mlx.core as mx
a = mx.random.normal((512, 512)); b = mx.random.normal((512, 2048)); mx.eval(a @ b)
started = time.perf_counter(); [mx.eval(a @ b) for _ in range(3)]
status = blas.status()
print(json.dumps({{"name": status.name, "threads": status.threads, "note": status.note,
    "bound": blas._library_providing("cblas_sgemm"),
    "matmul_ms": (time.perf_counter() - started) / 3 * 1e3}}))
"""

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the BLAS swap is Linux-only")


def report(environment: dict[str, str], before: str = "") -> tuple[dict, str]:
    process = subprocess.run(
        [sys.executable, "-c", REPORT.format(before=before)],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        env={"PATH": "/usr/bin:/bin", **environment},
        timeout=120,
    )
    assert process.returncode == 0, process.stderr
    return json.loads(process.stdout), process.stderr


def test_this_process_runs_mlx_on_the_optimized_blas():
    status = blas.status()
    assert status.name in ("mkl", "openblas"), status.describe()
    assert Path(blas._library_providing("cblas_sgemm")).resolve() == Path(status.path)
    assert "bound" in status.describe()


def test_the_off_switch_restores_the_reference_blas_and_its_speed():
    fast, _ = report({"TANDEM_BLAS_THREADS": "1"})
    slow, stderr = report({"TANDEM_BLAS": "reference", "TANDEM_BLAS_THREADS": "1"})
    assert fast["name"] in ("mkl", "openblas") and fast["threads"] == 1
    assert slow["name"] == "reference" and "turned off" in slow["note"]
    # mlx's own libblas is loaded locally to libmlx: nothing global provides cblas_sgemm.
    assert slow["bound"] is None and stderr == ""
    assert slow["matmul_ms"] > 4 * fast["matmul_ms"]  # measured ~15x on two cores


def test_mlx_imported_first_falls_back_with_one_warning_line():
    got, stderr = report({}, before="import mlx.core")
    assert got["name"] == "reference"
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "reference BLAS" in lines[0] and "imported before" in lines[0]


def test_an_unknown_choice_falls_back_with_one_warning_line():
    got, stderr = report({"TANDEM_BLAS": "fastest"})
    assert got["name"] == "reference"
    assert len(stderr.strip().splitlines()) == 1 and "'fastest'" in stderr


def test_threads_can_be_resized():
    before = blas.status().threads
    try:
        assert blas.set_threads(1).threads == 1
    finally:
        blas.set_threads(before)
    started = time.perf_counter()
    assert blas.status().threads == before and time.perf_counter() - started < 1
