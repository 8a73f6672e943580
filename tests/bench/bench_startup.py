"""What a tandem process pays to start: importing mlx-lm with and without transformers' import
table on disk (engines/core/import_index.py), and `tandem serve` from spawn to healthy.

Run from the project root: `python -m tests.bench.bench_startup` (about a minute).
Interleaved rounds (A B A B ...), medians with the range; each import in a fresh interpreter
with a warm file cache. Writes "## Start-up" in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from engines.model.demo import ensure_demo_model
from tests.bench.bench_engine_core import tandem
from tests.bench.common import describe_machine, markdown_table, write_section

HEADING = "## Start-up"
COMMAND = "python -m tests.bench.bench_startup"
ROOT = Path(__file__).resolve().parents[2]
IMPORTS = {
    "`import mlx_lm.utils` (transformers scans its ~1,700 model files)": "import mlx_lm.utils",
    "`import engines, mlx_lm.utils` (the table read from disk; engines loads MKL too)": (
        "import engines, mlx_lm.utils"
    ),
}


def seconds(code: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - started


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    seconds(IMPORTS[next(reversed(IMPORTS))])  # the index is written once, then read
    timings: dict[str, list[float]] = {name: [] for name in IMPORTS}
    for _ in range(args.rounds):
        for name, code in IMPORTS.items():
            timings[name].append(seconds(code))
    healthy = []
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as cleanup:
        client = httpx.Client(trust_env=False, timeout=30)
        cleanup.callback(client.close)
        model = ensure_demo_model(Path(scratch) / "model")  # built once, outside the timing
        for _ in range(args.rounds):
            started = time.perf_counter()
            server = tandem("serve", model, Path(scratch), cleanup, client, [])
            healthy.append(time.perf_counter() - started)
            server.stop()
    rows = [[name, spread(values)] for name, values in timings.items()]
    rows.append(["`tandem serve` of the demo model, single: spawn to /health 200",
                 spread(healthy)])  # fmt: skip
    body = (
        f"Command: `{COMMAND}` (--rounds {args.rounds}). {describe_machine()}\n\n"
        + markdown_table(["", "seconds, median (min-max)"], rows)
    )
    write_section(HEADING, body)
    print(body)


if __name__ == "__main__":
    main()
