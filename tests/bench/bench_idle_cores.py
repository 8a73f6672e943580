"""Does a pipeline's stage run slower after its core has idled? A 1-stream pipeline leaves
each core idle while the other stages compute; a core that stays busy shows what that costs.

Run from the project root on a two-core machine: `python -m tests.bench.bench_idle_cores`
(about five minutes). Over loopback, no lab: the engine in this process on core 0, the last
stage's worker on core 1 (tests/bench/pipeline_cluster.py), the 16-layer hidden-1024 demo
model, one BLAS thread. Each round first measures each core with the speed probe in a child
process (as the coordinator and an agent do), then serves 3 streams of 64 tokens one after
another and sets the engine's own 1-stream segments beside the probe's: as is, then with a
process spinning at idle priority (SCHED_IDLE) on each core, so that neither core halts
while the other stage works (the spinner yields to any other work at once). Prints a table;
writes nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

from engines.observability.served_speed import one_stream_segments_ms
from tests.bench.common import PROJECT_ROOT, counts_between, markdown_table

ROUNDS = 2  # per variant, alternating
TOKENS = 64
PROMPT = "A second machine should make this answer"
PROBE = (
    "import json, sys\n"
    "from engines.core import blas\n"
    "blas.activate(); blas.set_threads(1)\n"
    "from engines.model import speed_probe\n"
    "m = speed_probe.measure(json.load(open(sys.argv[1])), rows=(1,), tp_sizes=())\n"
    "print(json.dumps([m['layer'][0][1], m['head'][0][1]]))\n"
)
SPIN = "while True: pass"


def probe(model: Path, core: int) -> tuple[float, float]:
    """(a layer's seconds at 1 row, the head's) on `core`, in a child process."""
    done = subprocess.run(
        ["taskset", "-c", str(core), sys.executable, "-c", PROBE, str(model / "config.json")],
        capture_output=True, text=True, cwd=PROJECT_ROOT, check=True, timeout=120,
    )  # fmt: skip
    layer, head = json.loads(done.stdout.strip().splitlines()[-1])
    return layer, head


def pin_children(core: int) -> None:
    """Every thread of this process's children onto `core` (the stage worker): Linux sets
    affinity per thread, and a child's BLAS and mlx threads exist by now."""
    for child in psutil.Process().children():
        for thread in child.threads():
            os.sched_setaffinity(thread.id, {core})


def serve_one_stream(model: Path) -> tuple[float, dict[str, float]]:
    """(median 1-stream decode tok/s, the engine's mean 1-stream segments in ms)."""
    from engines.core.request import GenerationRequest
    from tests.bench.pipeline_cluster import open_pipeline_runner

    os.sched_setaffinity(0, {0})
    try:
        with open_pipeline_runner(model, 2, max_batch=8) as runner:
            pin_children(1)
            prompt = tuple(runner.engine.tokenizer.encode(PROMPT))

            async def one() -> list[float]:
                stamps = []
                request = GenerationRequest("bench", prompt, TOKENS)
                async for _ in runner.submit(request).events():
                    stamps.append(time.perf_counter())
                return stamps

            asyncio.run(one())  # warm-up
            before = runner.engine.step_timing.snapshot()
            rates = []
            for _ in range(3):
                stamps = asyncio.run(one())
                rates.append((len(stamps) - 2) / (stamps[-1] - stamps[1]))
            after = runner.engine.step_timing.snapshot()
    finally:
        os.sched_setaffinity(0, {0, 1})
    return statistics.median(rates), segments_between(before, after)


def segments_between(before: dict, after: dict) -> dict[str, float]:
    """The mean 1-stream segments of the steps between two StepTimes snapshots."""
    grown = counts_between(before.get("one_row") or {}, after.get("one_row") or {})
    return one_stream_segments_ms({"one_row": grown})


def spinners() -> list[subprocess.Popen]:
    """A busy loop at idle priority on each core."""
    command = ["chrt", "-i", "0", sys.executable, "-c", SPIN]
    return [subprocess.Popen(["taskset", "-c", str(core), *command]) for core in (0, 1)]


def one_round(model: Path, spin: bool) -> list[str]:
    (layer0, _), (layer1, head1) = probe(model, 0), probe(model, 1)
    stage0, stage1 = 8 * layer0 * 1000, (8 * layer1 + head1) * 1000  # 16 layers, 8 a stage
    busy = spinners() if spin else []
    try:
        rate, served = serve_one_stream(model)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    predicted = 1000 / (stage0 + stage1)

    def beside(name: str, ms: float) -> str:
        got = served.get(name, 0.0)
        return f"{ms:.1f} -> {got:.1f} ({100 * (got / ms - 1):+.0f}%)"

    return [
        "a busy-looping idle-priority process on each core" if spin else "as is",
        f"{predicted:.1f}", f"{rate:.1f}", f"{100 * (predicted / rate - 1):+.0f}%",
        beside("stage0", stage0), beside("stage1", stage1), f"{served.get('transit', 0):.2f}",
    ]  # fmt: skip


def main() -> None:
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("bench_idle_cores: needs two cores")
    from engines.core import blas

    blas.activate()
    blas.set_threads(1)
    from engines.model.demo import ensure_demo_model
    from engines.model.demo_spec import DemoSpec

    model = ensure_demo_model(Path("/tmp/tandem-bench"), DemoSpec(layers=16, hidden=1024))
    rows = [one_round(model, spin) for _ in range(ROUNDS) for spin in (False, True)]
    print(markdown_table(
        ["cores between stages", "predicted 1-stream tok/s", "served", "error",
         "stage 0 ms, predicted -> served", "stage 1 ms", "transit ms"],
        rows,
    ))  # fmt: skip


if __name__ == "__main__":
    main()
