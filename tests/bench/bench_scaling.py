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
from tests.bench.common import PROJECT_ROOT, markdown_table, write_section
from tests.lab.machines import Lab, Machine, MachineSpec, lab_unavailable

LAYERS, HIDDEN = 16, 1024
ROUNDS = 5
MAX_TOKENS = 64
STREAMS = 8
PORT = 8000
READY_S = 300.0
PYTHON = [sys.executable, "-m", "cli.main"]
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


def many_streams(url: str) -> float:
    """Aggregate tok/s of STREAMS concurrent streams, first token to last."""
    stamps: list[list[float]] = [[] for _ in range(STREAMS)]
    threads = [threading.Thread(target=stream, args=(url, s, i)) for i, s in enumerate(stamps)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = sorted(stamp for s in stamps for stamp in s)
    return (len(every) - STREAMS) / (every[-1] - min(s[0] for s in stamps))


def step_means(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Mean ms per step of each engine segment between two /v1/cluster snapshots."""
    first = (before.get("engine") or {}).get("step_timing") or {}
    last = (after.get("engine") or {}).get("step_timing") or {}
    parts = []
    for name, values in (last.get("segments") or {}).items():
        old = (first.get("segments") or {}).get(name, {"count": 0, "sum": 0.0})
        count = values["count"] - old["count"]
        if count:
            parts.append(f"{name} {1000 * (values['sum'] - old['sum']) / count:.1f}")
    return ", ".join(parts) or "—"


def measure(config: Config, model_args: list[str]) -> dict[str, Any]:
    specs = [
        MachineSpec(cores=str(index % 2), cpu_quota=config.cpu_quota)
        for index in range(config.machines)
    ]
    with Lab(config.machines, specs) as lab:
        url = start(config, lab, model_args)
        one_stream(url)  # warm-up
        before = httpx.get(url + "/v1/cluster", timeout=10).json()
        singles = [one_stream(url) for _ in range(ROUNDS)]
        after = httpx.get(url + "/v1/cluster", timeout=10).json()
        aggregate = statistics.median(many_streams(url) for _ in range(3))
    return {
        "decode": statistics.median(rate for rate, _ in singles),
        "ttft": statistics.median(ttft for _, ttft in singles),
        "aggregate": aggregate,
        "steps": step_means(before, after),
        "strategy": after.get("strategy"),
    }


def main() -> None:
    problem = lab_unavailable()
    if problem:
        raise SystemExit(f"bench_scaling: {problem}")
    from engines.model.demo import DemoSpec, ensure_demo_model

    model = ensure_demo_model(Path("/tmp/tandem-bench"), DemoSpec(layers=LAYERS, hidden=HIDDEN))
    model_args = ["--model", str(model)]  # the coordinator's copy; agents receive theirs
    results = {config.name: measure(config, model_args) for config in CONFIGS}
    rows = []
    for config in CONFIGS:
        result = results[config.name]
        base = results[CONFIGS[3].name if config.cpu_quota else CONFIGS[0].name]
        rows.append([
            config.name, str(config.machines), f"{result['decode']:.1f}",
            f"{result['decode'] / base['decode']:.2f}x", f"{result['aggregate']:.1f}",
            f"{result['aggregate'] / base['aggregate']:.2f}x", f"{1000 * result['ttft']:.0f}",
            result["steps"],
        ])
    table = markdown_table(
        ["configuration", "machines", "1-stream tok/s", "vs single", f"{STREAMS}-stream tok/s",
         "vs single", "TTFT ms", "engine step, ms (mean per step or frame)"],
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
