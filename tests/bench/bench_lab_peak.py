"""Peak throughput in the lab (issue 39): the best aggregate tok/s of single and of a pipeline
over 8, 16, 32 and 64 concurrent streams, on separate lab machines.

At a fixed 8 streams a pipeline cannot beat one machine whose decode is bound by reading its
weights: that machine batches all 8 rows in one read. A pipeline's gain shows where single
saturates, so each contender's peak is compared, round by round.

Run from the project root, as root: `python -m tests.bench.bench_lab_peak` (about fifteen
minutes): single and pp=2 on machines of one pinned core; `--half` instead: single and pp=3 on
machines of half a core each (a CPU quota); `--rounds N`, `--no-write`. One lab holds every
contender's machines (tests/lab/machines.py), each `tandem serve` started once and kept up,
idle while another is timed; rounds interleave the contenders, each round starting one
contender later. The model is bench_scaling's 16-layer hidden-1024 demo (it sits outside the
machines' homes, so no transfer), one BLAS thread per process, `--max-batch 64`, greedy, no
prefix cache. Writes "## Peak throughput in the lab" (with `--half`, its half-core section) in
docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.bench.bench_lab_speculation import option
from tests.bench.bench_lab_speculation import start_all as start_lab_servers
from tests.bench.bench_scaling import HIDDEN, LAYERS, environment
from tests.bench.common import PROJECT_ROOT, markdown_table, write_section
from tests.lab.machines import Lab, Machine, MachineSpec, lab_unavailable

HEADING = "## Peak throughput in the lab"
HALF_HEADING = "## Peak throughput in the lab, half-core machines"
COMMAND = "python -m tests.bench.bench_lab_peak"
ROUNDS = 5
STREAMS = (8, 16, 32, 64)
MAX_TOKENS = 64
CONTEXT_TOKENS = 128  # KV is reserved for --max-batch sequences of this many tokens
MEMORY_LIMIT = 4 * 1024**3  # a memory cgroup per machine, so that closing the lab sweeps it
HALF_CORE = 0.5
PORT = 8000
PYTHON = [sys.executable, "-m", "cli.main"]
PROMPT = "Stream {index} of the peak benchmark writes about machine number {index}:"


@dataclass(frozen=True, slots=True)
class Contender:
    """One `tandem serve` over `machines` lab machines, each pinned to a core or on a quota."""

    name: str
    parallelism: str
    machines: int
    quota: float | None = None  # None: one pinned core per machine

    def specs(self) -> list[MachineSpec]:
        if self.quota is not None:
            return [MachineSpec(cpu_quota=self.quota, memory_limit=MEMORY_LIMIT)] * self.machines
        return [
            MachineSpec(cores=str(index % 2), memory_limit=MEMORY_LIMIT)
            for index in range(self.machines)
        ]


ONE_CORE = (Contender("single", "single", 1), Contender("pp=2", "pp", 2))
HALF = (
    Contender("single, half a core", "single", 1, HALF_CORE),
    Contender("pp=3, half a core each", "pp", 3, HALF_CORE),
)
TARGETS = {"pp=2": 1.7, "pp=3, half a core each": 2.3}  # issue 39, against its single


def serve(contender: Contender, coordinator: Machine, key: str, model: Path) -> None:
    coordinator.popen(
        [*PYTHON, "serve", "--model", str(model), "--model-id", "demo",
         "--parallelism", contender.parallelism, "--measure-speeds", "off",
         "--max-batch", str(max(STREAMS)), "--queue-size", str(max(STREAMS)),
         "--context-tokens", str(CONTEXT_TOKENS), "--prefix-cache-bytes", "0",
         "--interface", coordinator.address,
         "--host", coordinator.address, "--port", str(PORT), "--cluster-key", key],
        log=coordinator.home / "serve.log", cwd=PROJECT_ROOT, env=environment(coordinator),
    )  # fmt: skip


def start_all(lab: Lab, contenders: tuple[Contender, ...], model: Path) -> dict[str, str]:
    """Every contender's cluster, started and checked (bench_lab_speculation's); their URLs."""
    servers = start_lab_servers(lab, contenders, model, serve)
    return {name: server.url for name, server in servers.items()}


async def burst(url: str, count: int) -> float:
    """`count` greedy completions at once: aggregate completion tokens per second."""

    async def one(client: httpx.AsyncClient, index: int) -> int:
        body = {
            "model": "demo", "prompt": PROMPT.format(index=index), "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }  # fmt: skip
        response = await client.post(url + "/v1/completions", json=body, timeout=600)
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {response.text}")
        return response.json()["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=max(STREAMS))
    async with httpx.AsyncClient(trust_env=False, limits=limits) as client:
        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(client, index) for index in range(count)))
        return sum(tokens) / (time.perf_counter() - started)


def measure(urls: dict[str, str], rounds: int) -> dict[str, list[dict[int, float]]]:
    """Per contender, per round: aggregate tok/s at every stream count (after a warm-up)."""
    names = list(urls)
    for name in names:
        asyncio.run(burst(urls[name], max(STREAMS)))
    found: dict[str, list[dict[int, float]]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            rates = {count: asyncio.run(burst(urls[name], count)) for count in STREAMS}
            found[name].append(rates)
            shown = ", ".join(f"x{count} {rate:.1f}" for count, rate in rates.items())
            print(f"round {round_ + 1} {name}: {shown} tok/s", flush=True)
    return found


def spread(values: list[float], digits: int = 2) -> str:
    low, middle, high = min(values), statistics.median(values), max(values)
    return f"{middle:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def table(pair: tuple[Contender, ...], found: dict[str, list[dict[int, float]]]) -> str:
    """Each contender's median tok/s per stream count and its peak; the pipeline's peak over
    single's, per round."""
    single, *others = pair
    base = [max(rates.values()) for rates in found[single.name]]
    rows = []
    for contender in pair:
        runs = found[contender.name]
        peaks = [max(rates.values()) for rates in runs]
        ratio = "baseline"
        if contender is not single:
            ratios = [peak / other for peak, other in zip(peaks, base, strict=True)]
            ratio = f"**{spread(ratios)}** (target {TARGETS[contender.name]}x)"
        rows.append([
            contender.name,
            *(f"{statistics.median(rates[count] for rates in runs):.1f}" for count in STREAMS),
            spread(peaks, 1), ratio,
        ])  # fmt: skip
    counts = [f"x{count} tok/s" for count in STREAMS]
    header = ["contender", *counts, "peak tok/s", "peak vs single"]
    return markdown_table(header, rows)


def main() -> None:
    if problem := lab_unavailable():
        raise SystemExit(f"bench_lab_peak: {problem}")
    from engines.model.demo import ensure_demo_model
    from engines.model.demo_spec import DemoSpec

    rounds = option("--rounds", ROUNDS)
    half = "--half" in sys.argv
    pair = HALF if half else ONE_CORE
    model = ensure_demo_model(Path("/tmp/tandem-bench"), DemoSpec(layers=LAYERS, hidden=HIDDEN))
    began = time.monotonic()
    specs = [spec for contender in pair for spec in contender.specs()]
    with Lab(len(specs), specs) as lab:
        urls = start_all(lab, pair, model)
        print(f"every serve up after {time.monotonic() - began:.0f} s", flush=True)
        found = measure(urls, rounds)
    minutes = (time.monotonic() - began) / 60
    text = "\n\n".join(
        [
            f"`{COMMAND}{' --half' if half else ''}` (as root; {minutes:.0f} "
            f"minutes): the {LAYERS}-layer hidden-{HIDDEN} demo, one `tandem serve` per "
            "contender in one lab, all started once and kept up, idle while another is timed; "
            "one BLAS thread per process, `--max-batch 64`, no prefix cache. Each burst sends "
            f"N greedy completions of {MAX_TOKENS} tokens at once; aggregate tok/s are medians "
            f"of {rounds} interleaved rounds, a contender's peak is its best over "
            f"{', '.join(map(str, STREAMS))} streams in a round, and the ratio is per round "
            "against single's peak in the same round (median, lowest-highest).",
            table(pair, found),
        ]
    )
    print(text)
    if "--no-write" not in sys.argv:
        write_section(HALF_HEADING if half else HEADING, text)


if __name__ == "__main__":
    main()
