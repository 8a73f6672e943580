"""A slow coordinator beside a fast agent (issue 40's relay, chosen by auto): what auto by
measurement serves, against a pipeline over both and single on the coordinator.

Run from the project root, as root: `python -m tests.bench.bench_lab_relay` (about five
minutes; `--rounds N`, `--no-write`). One lab: every contender's coordinator runs on core 0
under a CPU quota of `COORDINATOR_QUOTA` (a laptop beside a desktop), its agent on core 1
unbounded; each `tandem serve` (the 8-layer hidden-512 demo, one BLAS thread per process,
speeds measured) is started once and kept up, idle while another is timed. Contenders:
`--parallelism auto`, which is checked to run the model alone on its agent (planner/relay.py);
`--parallelism pp` over both machines; `--parallelism single` on a coordinator alone. Rounds
interleave them; one greedy stream of 64 tokens a burst (tok/s over the burst, first token
included), `BURSTS` bursts a round, medians with the range. Writes "## A slow coordinator in
the lab" in docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.bench.bench_batching import http_contender
from tests.bench.bench_lab_speculation import PORT, option
from tests.bench.bench_lab_speculation import start_all as start_lab_servers
from tests.bench.bench_scaling import environment
from tests.bench.common import PROJECT_ROOT, markdown_table, write_section
from tests.lab.machines import Lab, Machine, MachineSpec, lab_unavailable

HEADING = "## A slow coordinator in the lab"
COMMAND = "python -m tests.bench.bench_lab_relay"
ROUNDS = 7
BURSTS = 3
COORDINATOR_QUOTA = 0.3
MEMORY_LIMIT = 2 * 1024**3
PYTHON = [sys.executable, "-m", "cli.main"]


@dataclass(frozen=True, slots=True)
class Contender:
    """A serve: its --parallelism (`flag`), the strategy it must run (`parallelism`, as
    /v1/cluster says it) and its machines, the coordinator first."""

    name: str
    flag: str
    parallelism: str
    machines: int

    def specs(self) -> list[MachineSpec]:
        coordinator = MachineSpec(cores="0", cpu_quota=COORDINATOR_QUOTA, memory_limit=MEMORY_LIMIT)
        return [coordinator, *[MachineSpec(cores="1", memory_limit=MEMORY_LIMIT)] * (
            self.machines - 1
        )]  # fmt: skip


CONTENDERS = (
    Contender("auto (measured)", "auto", "single", 2),
    Contender("pp=2", "pp", "pp", 2),
    Contender("single on the coordinator", "single", "single", 1),
)


def serve(contender: Contender, coordinator: Machine, key: str, model: Path) -> None:
    coordinator.popen(
        [*PYTHON, "serve", "--model", str(model), "--model-id", "demo",
         "--parallelism", contender.flag, "--measure-speeds", "on", "--collective", "ring",
         "--max-batch", "4", "--context-tokens", "256", "--prefix-cache-bytes", "0",
         "--interface", coordinator.address, "--host", coordinator.address,
         "--port", str(PORT), "--cluster-key", key],
        log=coordinator.home / "serve.log", cwd=PROJECT_ROOT, env=environment(coordinator),
    )  # fmt: skip


def measure(urls: dict[str, str], rounds: int) -> dict[str, list[float]]:
    """Per contender: one stream's tok/s, every burst of every round (after a warm-up)."""
    runs = {name: http_contender(url, "demo", 0.0) for name, url in urls.items()}
    for run in runs.values():
        asyncio.run(run(1))
    found: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            rates = [asyncio.run(runs[name](1)).tokens_per_s for _ in range(BURSTS)]
            found[name] += rates
            print(f"round {round_ + 1} {name}: {[round(r, 1) for r in rates]} tok/s", flush=True)
    return found


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    if problem := lab_unavailable():
        raise SystemExit(f"bench_lab_relay: {problem}")
    from engines.model.demo import ensure_demo_model
    from engines.model.demo_spec import DemoSpec

    rounds = option("--rounds", ROUNDS)
    model = ensure_demo_model(
        Path("/tmp/tandem-bench"), DemoSpec(layers=8, hidden=512, heads=8, kv_heads=8)
    )
    specs = [spec for contender in CONTENDERS for spec in contender.specs()]
    began = time.monotonic()
    with Lab(len(specs), specs) as lab:
        servers = start_lab_servers(lab, CONTENDERS, model, serve)
        statuses = {
            name: httpx.get(server.url + "/v1/cluster", timeout=30, trust_env=False).json()
            for name, server in servers.items()
        }
        if not statuses["auto (measured)"].get("relayed"):
            raise SystemExit(f"bench_lab_relay: auto did not relay: {statuses['auto (measured)']}")
        found = measure({name: server.url for name, server in servers.items()}, rounds)
    minutes = (time.monotonic() - began) / 60
    auto = statistics.median(found["auto (measured)"])
    rows = []
    for contender in CONTENDERS:
        status = statuses[contender.name]
        predicted = status["plan"]["predictions"][0]["decode_tps"]
        median = statistics.median(found[contender.name])
        rows.append([
            contender.name, f"{status['strategy']} on {', '.join(status['plan']['ranks'])}"
            + (" (relayed)" if status.get("relayed") else ""),
            f"{predicted:.1f}", spread(found[contender.name]), f"{auto / median:.2f}x",
        ])  # fmt: skip
    header = ["contender", "serves", "predicted tok/s", "served tok/s", "auto / this"]
    text = "\n\n".join(
        [
            f"`{COMMAND}` (as root; {minutes:.0f} minutes): the 8-layer hidden-512 demo; "
            f"each contender's coordinator on core 0 under a quota of {COORDINATOR_QUOTA} of a "
            "core, its agent on core 1; one `tandem serve` per contender, kept up, speeds "
            f"measured; one greedy stream of 64 tokens a burst, {BURSTS} bursts a round, "
            f"{rounds} interleaved rounds: medians (range) over every burst, first token "
            "included. `auto (measured)` runs the model alone on its agent.",
            markdown_table(header, rows),
            f"auto's reason: {statuses['auto (measured)']['reason']}",
        ]
    )
    print(text)
    if "--no-write" not in sys.argv:
        write_section(HEADING, text)


if __name__ == "__main__":
    main()
