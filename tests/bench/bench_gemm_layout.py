"""Linear layers weights first (engines/model/gemm_layout.py) against mlx's own `x @ W.T`.

Run from the project root: `python -m tests.bench.bench_gemm_layout` (about 20 minutes; the lab
part as root). Three parts, each one run of interleaved rounds, medians and spreads:

1. `gemm`: one Linear layer's product, both ways, for the shapes of the benchmarks' models and
   SmolLM2's, over 1 to 128 rows (this process's BLAS threads).
2. `served`: `tandem serve` of the 8-layer hidden-512 demo on this machine, greedy, 1 to 64
   streams of 64 tokens, `TANDEM_GEMM_LAYOUT=off` against the default.
3. `lab`: single and pp=2 on lab machines of one pinned core (bench_lab_peak's 16-layer
   hidden-1024 demo, `--max-batch 64`), peak aggregate tok/s over 32 and 64 streams, off
   against the default.

`--part gemm|served|lab` runs one; `--rounds N`; `--no-write`. Writes "## Linear layers
weights first" in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.bench.common import describe_machine, free_port, markdown_table, write_section

HEADING = "## Linear layers weights first"
COMMAND = "python -m tests.bench.bench_gemm_layout"
SHAPES = {  # (out, in) of one weight: which model's layer
    "16x1024 demo: q, o": (1024, 1024),
    "16x1024 demo: gate, up": (2048, 1024),
    "16x1024 demo: down": (1024, 2048),
    "SmolLM2: gate, up": (1536, 576),
    "SmolLM2: down": (576, 1536),
    "SmolLM2: head (vocabulary)": (49152, 576),
}
GEMM_ROWS = (1, 8, 16, 32, 48, 64, 128)
SERVED_STREAMS = (1, 8, 16, 32, 64)
LAB_STREAMS = (32, 64)
OFF = {"TANDEM_GEMM_LAYOUT": "off"}
HOST = "127.0.0.1"


def spread(values: list[float], digits: int = 2) -> str:
    low, middle, high = min(values), statistics.median(values), max(values)
    return f"{middle:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


# -- 1. one product ------------------------------------------------------------------------------


def measure_gemm(rounds: int) -> str:
    import mlx.core as mx

    from engines.model.gemm_layout import time_both

    rows_out = []
    for name, (out, inner) in SHAPES.items():
        weight = mx.random.normal((out, inner))
        mx.eval(weight)
        cells = []
        for rows in GEMM_ROWS:
            ratios = []
            for _ in range(rounds):
                usual, weights_first = time_both(weight, rows)
                ratios.append(usual / weights_first)
            cells.append(f"{statistics.median(ratios):.2f}")
        rows_out.append([name, *cells])
    header = ["layer (out x in)", *(f"{rows} rows" for rows in GEMM_ROWS)]
    return (
        "One product, `x @ W.T` over `(W @ x.T).T` made contiguous (above 1: weights first is "
        f"faster), median of {rounds} timings of 3 each:\n\n" + markdown_table(header, rows_out)
    )


# -- 2. served on this machine -------------------------------------------------------------------


def measure_served(rounds: int) -> str:
    from engines.model.demo import ensure_demo_model
    from tests.bench.bench_batching import http_contender
    from tests.bench.bench_single import MODEL, MODEL_CACHE, ServerProcess

    model = ensure_demo_model(MODEL_CACHE, MODEL)
    found: dict[str, dict[int, list[float]]] = {"off": {}, "weights first": {}}
    with contextlib.ExitStack() as cleanup, httpx.Client(trust_env=False) as client:
        scratch = Path(cleanup.enter_context(tempfile.TemporaryDirectory()))
        contenders = {}
        for name, extra_env in (("off", OFF), ("weights first", {})):
            port = free_port(HOST)
            command = [
                sys.executable, "-m", "cli.main", "serve", "--parallelism", "single",
                "--model", str(model), "--model-id", "demo", "--host", HOST,
                "--port", str(port), "--interface", HOST, "--max-batch", "64",
                "--queue-size", "64", "--state-dir", str(scratch / f"{port}-state"),
                "--cache-dir", str(scratch / f"{port}-cache"),
            ]  # fmt: skip
            server = ServerProcess(
                name, command, port, scratch / f"{port}.log", env=os.environ | extra_env
            )
            cleanup.callback(server.stop)
            server.start()
            server.wait_healthy(client)
            contenders[name] = http_contender(server.base_url, "demo", 0.0)

        async def all_rounds() -> None:
            for contender in contenders.values():  # a warm-up each
                await contender(SERVED_STREAMS[-1])
            for round_ in range(rounds):
                names = list(contenders)
                names = names[round_ % 2 :] + names[: round_ % 2]
                for streams in SERVED_STREAMS:
                    for name in names:
                        burst = await contenders[name](streams)
                        found[name].setdefault(streams, []).append(burst.tokens_per_s)

        asyncio.run(all_rounds())
    table = []
    for streams in SERVED_STREAMS:
        off, first = found["off"][streams], found["weights first"][streams]
        ratios = [b / a for a, b in zip(off, first, strict=True)]
        table.append([str(streams), spread(off, 1), spread(first, 1), f"**{spread(ratios)}x**"])
    header = ["streams", "off tok/s", "weights first tok/s", "weights first / off"]
    return (
        "`tandem serve` of the 8-layer hidden-512 demo on this machine, greedy, 64 tokens per "
        f"stream, `--max-batch 64`, {rounds} interleaved rounds:\n\n"
        + markdown_table(header, table)
    )


# -- 3. the lab --------------------------------------------------------------------------------


def measure_lab(rounds: int) -> str:
    from dataclasses import dataclass

    from engines.model.demo import ensure_demo_model
    from engines.model.demo_spec import DemoSpec
    from tests.bench import bench_lab_peak as peak
    from tests.bench import bench_lab_speculation as lab_servers
    from tests.bench.bench_scaling import HIDDEN, LAYERS
    from tests.lab.machines import Lab, lab_unavailable

    if problem := lab_unavailable():
        raise SystemExit(f"bench_gemm_layout --part lab: {problem}")

    @dataclass(frozen=True, slots=True)
    class Contender(peak.Contender):
        layout_off: bool = False

    contenders = (
        Contender("single, off", "single", 1, layout_off=True),
        Contender("single", "single", 1),
        Contender("pp=2, off", "pp", 2, layout_off=True),
        Contender("pp=2", "pp", 2),
    )
    specs = [spec for contender in contenders for spec in contender.specs()]
    model = ensure_demo_model(Path("/tmp/tandem-bench"), DemoSpec(layers=LAYERS, hidden=HIDDEN))
    with Lab(len(specs), specs) as lab:
        off_machines, taken = set(), 0
        for contender in contenders:
            if contender.layout_off:
                off_machines |= {
                    machine.address for machine in lab.machines[taken:][: contender.machines]
                }
            taken += contender.machines
        plain_environment = lab_servers.environment

        def environment(machine):  # the agents' and the coordinators' both
            extra = OFF if machine.address in off_machines else {}
            return plain_environment(machine) | extra

        lab_servers.environment = environment
        peak.environment = environment
        try:
            urls = peak.start_all(lab, contenders, model)
        finally:
            lab_servers.environment = plain_environment
            peak.environment = plain_environment
        found: dict[str, list[float]] = {contender.name: [] for contender in contenders}
        for url in urls.values():
            asyncio.run(peak.burst(url, LAB_STREAMS[-1]))
        for round_ in range(rounds):
            names = list(urls)
            names = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in names:
                best = max(asyncio.run(peak.burst(urls[name], count)) for count in LAB_STREAMS)
                found[name].append(best)
                print(f"round {round_ + 1} {name}: peak {best:.1f} tok/s", flush=True)
    table = []
    for name in ("single", "pp=2"):
        off, first = found[f"{name}, off"], found[name]
        ratios = [b / a for a, b in zip(off, first, strict=True)]
        table.append([name, spread(off, 1), spread(first, 1), f"**{spread(ratios)}x**"])
    pp_over_single = {
        label: [p / s for p, s in zip(found[pp], found[single], strict=True)]
        for label, pp, single in (
            ("off", "pp=2, off", "single, off"),
            ("weights first", "pp=2", "single"),
        )
    }
    header = ["plan", "off: peak tok/s", "weights first: peak tok/s", "weights first / off"]
    return (
        f"Lab machines of one pinned core, one BLAS thread each, the {LAYERS}-layer "
        f"hidden-{HIDDEN} demo, `--max-batch 64`, no prefix cache; a peak is the best "
        f"aggregate tok/s over {' and '.join(map(str, LAB_STREAMS))} greedy streams of "
        f"{peak.MAX_TOKENS} tokens; {rounds} interleaved rounds:\n\n"
        + markdown_table(header, table)
        + "\n\npp=2's peak over single's, per round: "
        + ", ".join(f"{label} **{spread(values)}x**" for label, values in pp_over_single.items())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "gemm", "served", "lab"), default="all")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    arguments = parser.parse_args()
    import engines  # noqa: F401  (MKL under mlx first)

    began = time.monotonic()
    parts = []
    if arguments.part in ("all", "gemm"):
        parts.append(measure_gemm(arguments.rounds))
    if arguments.part in ("all", "served"):
        parts.append(measure_served(arguments.rounds))
    if arguments.part in ("all", "lab"):
        parts.append(measure_lab(arguments.rounds))
    minutes = (time.monotonic() - began) / 60
    text = "\n\n".join(
        [
            f"`{COMMAND}` ({minutes:.0f} minutes; part {arguments.part}). {describe_machine()}",
            *parts,
        ]
    )
    print(text)
    if not arguments.no_write:
        write_section(HEADING, text)


if __name__ == "__main__":
    main()
