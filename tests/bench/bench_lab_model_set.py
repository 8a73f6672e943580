"""Two models on three lab machines (issue 40): each model alone on an agent, the coordinator
relaying both, against each model served alone on the same machines.

Run from the project root, as root: `python -m tests.bench.bench_lab_model_set` (about three
minutes; `--rounds N`, `--no-write`). One lab of three machines on this 2-core host, each on
a CPU quota so that they do not take each other's time: two agents of `AGENT_QUOTA` of a core,
and the coordinator (the API, both engine cores) of `COORDINATOR_QUOTA`. One `tandem serve
--parallelism single --model A --model B` (two 8-layer hidden-512 demo models, same shape,
other weights; one BLAS thread per process) places each model alone on an agent
(planner/relay.py), which this checks before measuring. Interleaved rounds of three phases:
A alone, B alone, A and B at once (`STREAMS` greedy streams of 64 tokens to each); aggregate
tok/s per model and the ratio together / alone per round, medians with the spread. What the
relay costs: a fourth machine (the first agent's core and quota) serves model A single, timed
alone in every round beside A relayed alone. The client runs on the host, outside the
machines' quotas.

Writes "## Several models in the lab" in docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

from discovery.cluster_key import format_key, generate_key
from tests.bench.bench_batching import Burst, http_contender
from tests.bench.bench_lab_speculation import option
from tests.bench.bench_scaling import environment
from tests.bench.common import PROJECT_ROOT, markdown_table, write_section
from tests.lab.machines import Lab, Machine, MachineSpec, lab_unavailable

HEADING = "## Several models in the lab"
COMMAND = "python -m tests.bench.bench_lab_model_set"
ROUNDS = 7
STREAMS = 4
AGENT_QUOTA = 0.7
COORDINATOR_QUOTA = 0.5
MEMORY_LIMIT = 2 * 1024**3
PORT = 8000
READY_S = 120.0
PYTHON = [sys.executable, "-m", "cli.main"]
TARGET = 0.9  # issue 40: each model at >= 0.9x of its throughput alone


def start(lab: Lab, models: dict[str, Path]) -> tuple[str, str]:
    """Two agents joined and serve started on the coordinator, and model A served single on
    the fourth machine; their URLs once healthy."""
    coordinator, *agents, apart = lab.machines
    apart.popen(
        [*PYTHON, "serve", "--model", str(models["a"]), "--model-id", "a",
         "--parallelism", "single", "--max-batch", str(2 * STREAMS), "--context-tokens", "256",
         "--prefix-cache-bytes", "0",
         "--interface", apart.address, "--host", apart.address, "--port", str(PORT)],
        log=apart.home / "serve.log", cwd=PROJECT_ROOT, env=environment(apart),
    )  # fmt: skip
    key = format_key(generate_key())
    for agent in agents:
        agent.popen(
            [*PYTHON, "join", "--cluster-key", key, "--interface", agent.address],
            log=agent.home / "join.log", cwd=PROJECT_ROOT, env=environment(agent),
        )  # fmt: skip
    wait_joined(agents)
    chosen = [flag for model_id, path in models.items() for flag in ("--model", str(path))]
    coordinator.popen(
        [*PYTHON, "serve", *chosen, "--parallelism", "single", "--measure-speeds", "off",
         "--max-batch", str(2 * STREAMS), "--context-tokens", "256",
         "--prefix-cache-bytes", "0", "--interface", coordinator.address,
         "--host", coordinator.address, "--port", str(PORT), "--cluster-key", key],
        log=coordinator.home / "serve.log", cwd=PROJECT_ROOT, env=environment(coordinator),
    )  # fmt: skip
    return healthy(coordinator), healthy(apart)


def healthy(machine: Machine) -> str:
    url = f"http://{machine.address}:{PORT}"
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).json()["status"] == "ok":
                return url
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    log = (machine.home / "serve.log").read_text()
    raise SystemExit(f"bench_lab_model_set: serve never became healthy:\n{log[-3000:]}")


def wait_joined(agents: list[Machine]) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if all("ready on" in (agent.home / "join.log").read_text() for agent in agents):
            return
        time.sleep(0.2)
    raise SystemExit("bench_lab_model_set: the agents never became ready")


def placed(url: str) -> dict[str, list[str]]:
    """Model id -> its nodes; SystemExit unless every model runs alone on an agent of its own."""
    current = httpx.get(url + "/v1/placements", timeout=30, trust_env=False).json()["current"]
    agents = [model["nodes"][-1] for model in current.values()]
    if not all(model["relayed"] for model in current.values()) or len(set(agents)) < 2:
        raise SystemExit(f"bench_lab_model_set: not one model per agent: {current}")
    return {model_id: model["nodes"] for model_id, model in current.items()}


def phase(url: str, ids: list[str]) -> dict[str, Burst]:
    """STREAMS streams to each model in `ids`, all at once."""

    async def run() -> list[Burst]:
        return await asyncio.gather(*(http_contender(url, i, 0.0)(STREAMS) for i in ids))

    return dict(zip(ids, asyncio.run(run()), strict=True))


def throttling(machine: Machine) -> tuple[int, int]:
    """(CFS periods, periods in which the machine's CPU quota ran out) so far."""
    [group] = [g for g in machine.cgroups if "cpu" in g.parts]
    stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
    return int(stat["nr_periods"]), int(stat["nr_throttled"])


def measure(
    url: str, apart_url: str, ids: list[str], rounds: int, coordinator: Machine
) -> tuple[dict[str, dict[str, list[float]]], list[float], dict[str, list[int]]]:
    """Per model: its tok/s alone and together, one value per round (after a warm-up); model
    A's tok/s single on a machine of its own, per round; and per kind of phase, the
    coordinator's [periods, throttled periods]."""
    phase(url, list(ids))
    phase(apart_url, ["a"])
    found: dict[str, dict[str, list[float]]] = {i: {"alone": [], "together": []} for i in ids}
    throttled = {"alone": [0, 0], "together": [0, 0]}
    single: list[float] = []
    phases: list[list[str]] = [[ids[0]], [ids[1]], ids, []]  # []: A single on its machine
    for round_ in range(rounds):
        shift = round_ % len(phases)
        for chosen in phases[shift:] + phases[:shift]:
            if not chosen:
                single.append(phase(apart_url, ["a"])["a"].tokens_per_s)
                print(f"round {round_ + 1} single: {single[-1]:.1f} tok/s", flush=True)
                continue
            before = throttling(coordinator)
            bursts = phase(url, list(chosen))
            kind = "together" if len(chosen) > 1 else "alone"
            after = throttling(coordinator)
            pairs = zip(throttled[kind], after, before, strict=True)
            throttled[kind] = [total + now - then for total, now, then in pairs]
            for model_id, burst in bursts.items():
                found[model_id][kind].append(burst.tokens_per_s)
            shown = ", ".join(f"{m} {b.tokens_per_s:.1f}" for m, b in bursts.items())
            print(f"round {round_ + 1} {kind}: {shown} tok/s", flush=True)
    return found, single, throttled


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(found: dict[str, dict[str, list[float]]], nodes: dict[str, list[str]]) -> str:
    rows = []
    for model_id, runs in found.items():
        ratios = [t / a for t, a in zip(runs["together"], runs["alone"], strict=True)]
        met = "met" if statistics.median(ratios) >= TARGET else "not met"
        rows.append([
            model_id, f"{nodes[model_id][-1]} (relayed)", spread(runs["alone"]),
            spread(runs["together"]), f"**{spread(ratios)}**", f">= {TARGET}x: {met}",
        ])  # fmt: skip
    header = ["model", "runs on", f"alone, {STREAMS} streams (tok/s)",
              "with the other's load (tok/s)", "together / alone", "issue 40's target"]  # fmt: skip
    return markdown_table(header, rows)


def relay_cost(relayed: list[float], single: list[float]) -> str:
    ratios = [r / s for r, s in zip(relayed, single, strict=True)]
    rows = [
        ["A single on a machine of its own", spread(single), "baseline"],
        ["A alone on an agent, relayed", spread(relayed), f"**{spread(ratios)}**"],
    ]
    return markdown_table([f"{STREAMS} streams of model A", "tok/s", "vs single"], rows)


def main() -> None:
    if problem := lab_unavailable():
        raise SystemExit(f"bench_lab_model_set: {problem}")
    from engines.model.demo import ensure_demo_model
    from tests.bench.bench_model_set import MODEL_A, MODEL_B

    rounds = option("--rounds", ROUNDS)
    root = Path("/tmp/tandem-bench")
    models = {"a": ensure_demo_model(root, MODEL_A), "b": ensure_demo_model(root, MODEL_B)}
    specs = [
        MachineSpec(cpu_quota=COORDINATOR_QUOTA, memory_limit=MEMORY_LIMIT),
        MachineSpec(cores="0", cpu_quota=AGENT_QUOTA, memory_limit=MEMORY_LIMIT),
        MachineSpec(cores="1", cpu_quota=AGENT_QUOTA, memory_limit=MEMORY_LIMIT),
        MachineSpec(cores="0", cpu_quota=AGENT_QUOTA, memory_limit=MEMORY_LIMIT),
    ]
    began = time.monotonic()
    with Lab(4, specs) as lab:
        url, apart_url = start(lab, models)
        nodes = placed(url)
        ids = list(nodes)  # the served order: A first
        print(f"serving {nodes} after {time.monotonic() - began:.0f} s", flush=True)
        found, single, throttled = measure(url, apart_url, ids, rounds, lab.machines[0])
    minutes = (time.monotonic() - began) / 60
    text = "\n\n".join(
        [
            f"`{COMMAND}` (as root; {minutes:.0f} minutes): two 8-layer hidden-512 demo "
            "models (same shape, other weights) under one `tandem serve --parallelism single "
            "--model A --model B` on three lab machines of this 2-core host: the coordinator "
            f"(the API and both engine cores) on {COORDINATOR_QUOTA} of a core, two agents on "
            f"{AGENT_QUOTA} of a core each (CPU quotas, so that no machine takes another's "
            "time); one BLAS thread per process. The placement runs each model alone on an "
            "agent, the coordinator relaying (planner/relay.py). Rounds interleave A alone, B "
            f"alone and both at once, {STREAMS} greedy streams of 64 tokens to each; medians "
            f"over {rounds} rounds with the range, the ratio per round. The client runs on the "
            "host.",
            table(found, nodes),
            "The coordinator ran out of its CPU quota in "
            + " and ".join(
                f"{100 * hit / max(periods, 1):.0f}% of its 100 ms periods {kind}"
                for kind, (periods, hit) in throttled.items()
            )
            + " (cpu.stat).",
            "What the relay costs: model A served single on a fourth machine with the first "
            "agent's core and quota, timed alone in every round beside A alone on its agent "
            "(ratio per round):",
            relay_cost(found[ids[0]]["alone"], single),
        ]
    )
    print(text)
    if "--no-write" not in sys.argv:
        write_section(HEADING, text)


if __name__ == "__main__":
    main()
