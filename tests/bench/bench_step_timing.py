"""Engine step timing: where a tp step and a pp frame spend their time, at 1 and 4 streams.

Run from the project root: `python -m tests.bench.bench_step_timing` (about a minute). A
two-rank ring and a two-stage sealed pipeline over 127.0.0.1 decode greedy streams of the
benchmark demo model; the table is each engine's own step timing
(engines/observability/step_timing.py, what /metrics exports as tandem_engine_step_seconds),
the mean per step in milliseconds. It prints a markdown section and writes it to
docs/benchmarks.md under "## Engine step timing".
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.model.demo import write_demo_model
from engines.model.demo_spec import DemoSpec
from tests.bench.common import BENCHMARKS_DOC, markdown_table, write_section
from tests.bench.pipeline_cluster import open_pipeline_runner
from tests.bench.tp_cluster import open_tensor_parallel_runner
from tests.helpers.engine import run_all

MODEL = DemoSpec(layers=8, hidden=512, heads=8, kv_heads=4, vocab=1024)
PROMPT = "The step timing benchmark splits every step of the engine into its parts."
DECODE_TOKENS = 64
STREAMS = (1, 4)
HEADING = "## Engine step timing"
COMMAND = "python -m tests.bench.bench_step_timing"
SEGMENTS = {
    "tp": ("all_sum", "compute", "step", "exchange"),
    "pp": ("stage0", "stage1", "seal", "transit", "round_trip"),
}


def mean_segments(runner: EngineRunner, streams: int) -> tuple[int, dict[str, float]]:
    """Run `streams` greedy streams at once; (steps, mean seconds per step by segment) of
    just this burst."""
    before = runner.engine.info().detail["step_timing"]
    prompt = tuple(runner.engine.tokenizer.encode(PROMPT))
    requests = [
        GenerationRequest(f"timing-{index}", prompt, DECODE_TOKENS) for index in range(streams)
    ]
    run_all(runner, requests)
    after = runner.engine.info().detail["step_timing"]
    steps = after["steps"] - before["steps"]
    means = {}
    for name, values in after["segments"].items():
        earlier = before["segments"].get(name, {"count": 0, "sum": 0.0})
        count = values["count"] - earlier["count"]
        means[name] = (values["sum"] - earlier["sum"]) / count if count else 0.0
    return steps, means


def measure(model: Path) -> list[list[str]]:
    rows = []
    engines: dict[str, Callable[[], AbstractContextManager[EngineRunner]]] = {
        "tp2": lambda: open_tensor_parallel_runner(model, 2),
        "pp2": lambda: open_pipeline_runner(model, 2),
    }
    for name, open_runner in engines.items():
        with open_runner() as runner:
            mean_segments(runner, 1)  # warm-up
            for streams in STREAMS:
                steps, means = mean_segments(runner, streams)
                cells = [f"{means.get(s, 0.0) * 1000:.2f} {s}" for s in SEGMENTS[name[:2]]]
                rows.append([name, str(streams), str(steps), ", ".join(cells)])
    return rows


def render(rows: list[list[str]], load: str) -> str:
    setup = (
        f"Demo model: llama, {MODEL.layers} layers, hidden {MODEL.hidden}, float32; one "
        f"{DECODE_TOKENS}-token greedy stream per row of the burst, all at once. Each engine's "
        "own step timing (docs/observability.md, engine step timing): the mean of each segment "
        "per tp step or pp frame, in milliseconds."
    )
    table = markdown_table(["engine", "streams", "steps", "mean ms per step"], rows)
    notes = (
        "- Both ranks / both stages share this machine's 2 cores with the coordinator, so "
        "`all_sum` (tp) and `transit` (pp) include waiting for the other process to be "
        "scheduled, not just the loopback network.\n"
        f"- Load average at start / end: {load}; other engineers' tests ran on the machine."
    )
    return "\n\n".join([setup, table.rstrip(), notes, f"Command: `{COMMAND}`"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=BENCHMARKS_DOC)
    arguments = parser.parse_args()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as directory:
        rows = measure(write_demo_model(Path(directory) / "bench-model", MODEL))
    section = render(rows, f"{load_start:.1f} / {os.getloadavg()[0]:.1f}")
    sys.stdout.write(f"{HEADING}\n\n{section}\n")
    write_section(HEADING, section, arguments.output)


if __name__ == "__main__":
    main()
