"""What a second (and third) machine buys: single vs tp and pp over separate lab machines.

Run from the project root, as root: `python -m tests.bench.bench_scaling` (about eight minutes).
Every configuration is a fresh cluster of lab machines (tests/lab/machines.py: network
namespaces on one bridge; the model sits outside their private homes, so no transfer), one
core each and one BLAS thread per process, serving a 16-layer, hidden-1024 demo model: single
on one machine, tp=2 and pp=2 over two; then, with half a core each (a CPU quota: this box has
two cores), single on one such machine against pp=3 over three. The client streams through the
OpenAI API from the host: 1-stream decode tok/s and time to first token (median of rounds),
8-stream aggregate tok/s, and each engine's own step breakdown from /v1/cluster (tp: all_sum,
compute, exchange; pp: per-stage compute, seal, transit). Writes "## Scaling" in
docs/benchmarks.md.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from discovery.cluster_key import format_key, generate_key
from tests.bench.common import PROJECT_ROOT, counts_between, markdown_table, write_section
from tests.lab.machines import Lab, Machine, MachineSpec, lab_unavailable

LAYERS, HIDDEN = 16, 1024
ROUNDS = 5
MAX_TOKENS = 64
STREAMS = 8
PORT = 8000
READY_S = 300.0
PYTHON = [sys.executable, "-m", "cli.main"]
RING_PORT = 5522
PROMPT = "A second machine should make this answer arrive faster, token after token, because"


@dataclass(frozen=True, slots=True)
class Config:
    name: str
    parallelism: str
    machines: int
    cpu_quota: float | None = None


CONFIGS = (
    Config("single, 1 machine", "single", 1),
    Config("tp=2 over the ring", "tp", 2),
    Config("pp=2", "pp", 2),
    Config("single, 1 half-core machine", "single", 1, 0.5),
    Config("pp=3, half a core each", "pp", 3, 0.5),
)


def environment(machine: Machine) -> dict[str, str]:
    return machine.env({"TANDEM_BLAS_THREADS": "1"})  # one core, one BLAS thread


def start(config: Config, lab: Lab, model_args: list[str]) -> str:
    key = format_key(generate_key())
    coordinator, *agents = lab.machines
    for agent in agents:
        agent.popen(
            [*PYTHON, "join", "--cluster-key", key, "--interface", agent.address],
            log=agent.home / "join.log", cwd=PROJECT_ROOT, env=environment(agent),
        )
    coordinator.popen(
        [*PYTHON, "serve", "--parallelism", config.parallelism, "--collective", "ring",
         "--interface", coordinator.address, "--host", coordinator.address,
         "--port", str(PORT), "--cluster-key", key, "--model-id", "demo",
         "--max-batch", str(STREAMS), "--prefix-cache-bytes", "0", *model_args],
        log=coordinator.home / "serve.log", cwd=PROJECT_ROOT, env=environment(coordinator),
    )
    url = f"http://{coordinator.address}:{PORT}"
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                return url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    raise RuntimeError((coordinator.home / "serve.log").read_text()[-3000:])


def stream(url: str, stamps: list[float], index: int = 0) -> None:
    body = {"model": "demo", "prompt": f"{PROMPT} {index}", "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("text"):
                    stamps.append(time.monotonic())


def one_stream(url: str) -> tuple[float, float]:
    """(decode tok/s after the first token, seconds to the first token)."""
    started, stamps = time.monotonic(), []
    stream(url, stamps)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), stamps[0] - started


@dataclass(frozen=True)
class Streams:
    """A round of STREAMS concurrent streams: aggregate tok/s first token to last (`whole`),
    and while every stream decodes (`steady`: from the last stream's first token to the first
    stream's last, what a batch's decode speed means); `ramp_s`, the first tokens' spread."""

    whole: float
    steady: float
    ramp_s: float


def concurrent_streams(url: str) -> Streams:
    stamps: list[list[float]] = [[] for _ in range(STREAMS)]
    threads = [threading.Thread(target=stream, args=(url, s, i)) for i, s in enumerate(stamps)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = sorted(stamp for s in stamps for stamp in s)
    first, all_in = min(s[0] for s in stamps), max(s[0] for s in stamps)
    first_out = min(s[-1] for s in stamps)
    whole = (len(every) - STREAMS) / (every[-1] - first)
    inside = sum(1 for stamp in every if all_in < stamp <= first_out)
    steady = inside / (first_out - all_in) if first_out > all_in and inside else whole
    return Streams(whole, steady, all_in - first)


def many_streams(url: str) -> float:
    """Aggregate tok/s of STREAMS concurrent streams, first token to last."""
    return concurrent_streams(url).whole


def step_means(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Mean ms per step of each engine segment between two /v1/cluster snapshots."""
    first = (before.get("engine") or {}).get("step_timing") or {}
    last = (after.get("engine") or {}).get("step_timing") or {}
    grown = counts_between(first.get("segments") or {}, last.get("segments") or {})
    parts = [
        f"{name} {1000 * totals['sum'] / totals['count']:.1f}"
        for name, totals in grown.items()
        if totals["count"]
    ]
    return ", ".join(parts) or "—"


def measure(config: Config, model_args: list[str]) -> dict[str, Any]:
    specs = [
        MachineSpec(cores=str(index % 2), cpu_quota=config.cpu_quota)
        for index in range(config.machines)
    ]
    with Lab(config.machines, specs) as lab:
        url = start(config, lab, model_args)
        one_stream(url)  # warm-up
        before = cluster(url)
        singles = [one_stream(url) for _ in range(ROUNDS)]
        middle = cluster(url)
        aggregate = statistics.median(many_streams(url) for _ in range(3))
        after = cluster(url)
    return {
        "decode": statistics.median(rate for rate, _ in singles),
        "ttft": statistics.median(ttft for _, ttft in singles),
        "aggregate": aggregate,
        "steps": step_means(before, middle),
        "steps_many": step_means(middle, after),
        "strategy": after.get("strategy"),
    }


def cluster(url: str) -> dict[str, Any]:
    return httpx.get(url + "/v1/cluster", timeout=10).json()


def plain_forward(machines: int, model: Path) -> dict[str, float]:
    """tok/s of mlx-lm's bare forward at 1 and STREAMS rows on `machines` lab machines (sharded
    over plain mx.distributed when 2): the ceiling with no serving around it."""
    specs = [MachineSpec(cores=str(index % 2)) for index in range(machines)]
    with Lab(machines, specs) as lab:
        steps = plain_forward_on(lab.machines, model, (1, STREAMS), lab.root / "ring.json")
    return {
        "decode": 1000 / steps[1],
        "aggregate": 1000 * STREAMS / steps[STREAMS],
    }


def plain_forward_on(
    machines: list[Machine], model: Path, batches: tuple[int, ...], hostfile: Path
) -> dict[int, float]:
    """tests/bench/plain_forward.py on these lab machines (one ring group when several, its
    hosts written to `hostfile`): rank 0's median ms per decode step at each batch size."""
    hostfile.write_text(json.dumps([[f"{m.address}:{RING_PORT}"] for m in machines]))
    processes = []
    for rank, machine in enumerate(machines):
        extra = {"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)} if len(machines) > 1 else {}
        processes.append(machine.popen(
            [sys.executable, "-m", "tests.bench.plain_forward", str(model),
             *(str(batch) for batch in batches)],
            log=machine.home / "plain.log", cwd=PROJECT_ROOT,
            env={**environment(machine), **extra},
        ))  # fmt: skip
    for process in processes:
        if process.wait(READY_S) != 0:
            log = machines[processes.index(process)].home / "plain.log"
            raise RuntimeError(f"plain forward failed; {log}:\n{log.read_text()[-2000:]}")
    lines = (machines[0].home / "plain.log").read_text().splitlines()
    steps = json.loads(next(line for line in reversed(lines) if line.startswith("{")))
    return {int(batch): ms for batch, ms in steps["ms_per_step"].items()}


def plain_rows(plain: dict[int, dict[str, float]], single: dict[str, Any]) -> list[list[str]]:
    """The bare-forward rows: single's and tp=2's ceilings (ratios against served single)."""
    rows = []
    for machines, name in ((1, "plain mlx-lm forward, 1 machine"),
                           (2, "plain mx.distributed tp=2 forward")):
        result = plain[machines]
        rows.append([
            f"{name} (no tandem)", str(machines), f"{result['decode']:.1f}",
            f"{result['decode'] / single['decode']:.2f}x", f"{result['aggregate']:.1f}",
            f"{result['aggregate'] / single['aggregate']:.2f}x", "—", "bare forward", "",
        ])
    ratio_1 = plain[2]["decode"] / plain[1]["decode"]
    ratio_8 = plain[2]["aggregate"] / plain[1]["aggregate"]
    rows.append(["plain tp=2 vs plain single (the collective's own scaling)", "2",
                 "", f"{ratio_1:.2f}x", "", f"{ratio_8:.2f}x", "—", "", ""])
    return rows


def main() -> None:
    problem = lab_unavailable()
    if problem:
        raise SystemExit(f"bench_scaling: {problem}")
    from engines.model.demo import ensure_demo_model
    from engines.model.demo_spec import DemoSpec

    model = ensure_demo_model(Path("/tmp/tandem-bench"), DemoSpec(layers=LAYERS, hidden=HIDDEN))
    model_args = ["--model", str(model)]  # the coordinator's copy; agents receive theirs
    results = {config.name: measure(config, model_args) for config in CONFIGS}
    plain = {machines: plain_forward(machines, model) for machines in (1, 2)}
    rows = []
    for config in CONFIGS:
        result = results[config.name]
        base = results[CONFIGS[3].name if config.cpu_quota else CONFIGS[0].name]
        rows.append([
            config.name, str(config.machines), f"{result['decode']:.1f}",
            f"{result['decode'] / base['decode']:.2f}x", f"{result['aggregate']:.1f}",
            f"{result['aggregate'] / base['aggregate']:.2f}x", f"{1000 * result['ttft']:.0f}",
            result["steps"], result["steps_many"],
        ])
        if config.name == CONFIGS[2].name:  # after pp=2: the bare forward, same machines
            rows += plain_rows(plain, results[CONFIGS[0].name])
    table = markdown_table(
        ["configuration", "machines", "1-stream tok/s", "vs single", f"{STREAMS}-stream tok/s",
         "vs single", "TTFT ms", "engine step, 1 stream (ms per step or frame)",
         f"engine step, {STREAMS} streams"],
        rows,
    )
    print(table)
    write_section(
        "## Scaling",
        "`python -m tests.bench.bench_scaling` (as root): every row a fresh cluster of lab "
        f"machines (tests/lab/machines.py), one core each (the half-core rows: a CPU quota of "
        f"0.5), one BLAS thread per process, a {LAYERS}-layer hidden-{HIDDEN} float32 demo "
        f"model every machine reads from the same path; {ROUNDS} greedy 1-stream rounds "
        f"of {MAX_TOKENS} tokens (median) and three rounds of {STREAMS} concurrent streams "
        "(median aggregate), from the host through the OpenAI API. Ratios are against single "
        "on one machine of the same size.\n\n" + table,
    )


if __name__ == "__main__":
    main()
