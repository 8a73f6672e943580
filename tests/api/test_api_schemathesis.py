"""The OpenAPI document matches the server: a bounded schemathesis run with every check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.api import MB, served_app

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "tests" / "data" / "schemathesis.toml"
# Small, so that a long generated prompt is refused at once instead of prefilled for seconds
# on a busy CPU (the config allows that 400: a token count is no schema's business).
CONTEXT_TOKENS = 512
SEED = 1  # fixed, so a failure reproduces; `st run ... --seed N` explores others


def test_schemathesis_finds_nothing(demo_model_dir: Path, tmp_path: Path) -> None:
    with served_app(demo_model_dir, 4 * MB, CONTEXT_TOKENS, engine=True) as (url, _):
        finished = subprocess.run(
            [
                sys.executable,
                "-m",
                "schemathesis.cli",
                "--config-file",
                str(CONFIG),
                "run",
                f"{url}/openapi.json",
                "--checks",
                "all",
                "--max-examples",
                "5",
                "--seed",
                str(SEED),
                "--request-timeout",
                "30",
                "--max-response-time",
                "20",
            ],
            cwd=tmp_path,  # schemathesis keeps a .schemathesis cache in its working directory
            capture_output=True,
            text=True,
            timeout=300,
        )
    report = finished.stdout + finished.stderr
    assert finished.returncode == 0, report[-6000:]
    assert " passed" in report and "failure" not in report.lower(), report[-6000:]
