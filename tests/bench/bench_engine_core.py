"""The engine core in a process of its own, beside the code that ran it in serve's process.

Run from the project root: `python -m tests.bench.bench_engine_core` (about 15 minutes).
Two parts, each one run of interleaved rounds (A B C A B C ...), medians and spreads:

1. The 4-layer demo model (`--model demo`'s) at 1 and 64 concurrent streams (64 tokens
   each, greedy, `--max-batch 64`): `tandem serve --engine-core process` (the default),
   `--engine-core thread` (the same scheduler on a thread of serve), and the code before the
   split (`--before`, a commit checked out in a git worktree and served from there).
   Aggregate tok/s, and at 64 streams the p50 / p99 inter-token latency.
2. The 8-layer hidden-512 demo, temperature 0.8, no seed, 1 to 16 streams: tandem against
   mlx_lm.server with tandem's MKL preloaded (the same BLAS; without a seed it batches).

Writes "## Engine core apart" in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import psutil

from engines.model.demo import ensure_demo_model
from engines.model.demo_spec import DemoSpec
from tests.bench.bench_batching import Burst, http_contender, percentile
from tests.bench.bench_single import MODEL, MODEL_CACHE, ServerProcess, mlx_server_command
from tests.bench.common import describe_machine, free_port, markdown_table, write_section

HOST = "127.0.0.1"
HEADING = "## Engine core apart"
COMMAND = "python -m tests.bench.bench_engine_core"
BEFORE = "479c8f6"  # the last commit with the engine on a thread of serve
TINY_STREAMS = (1, 64)
SERVER_STREAMS = (1, 2, 4, 8, 16)
MAX_TOKENS = 64
ROOT = Path(__file__).resolve().parents[2]

Contender = Callable[[int], Awaitable[Burst]]


def tandem(
    name: str,
    model: Path,
    scratch: Path,
    cleanup: contextlib.ExitStack,
    client: httpx.Client,
    extra: list[str],
    cwd: Path = ROOT,
) -> ServerProcess:
    """`python -m cli.main serve` run from `cwd` (a worktree serves its own code)."""
    port = free_port(HOST)
    state = scratch / f"{port}"
    command = [
        sys.executable, "-m", "cli.main", "serve", "--parallelism", "single",
        "--model", str(model), "--host", HOST, "--port", str(port), "--interface", HOST,
        "--state-dir", str(state / "state"), "--cache-dir", str(state / "cache"), *extra,
    ]  # fmt: skip
    server = ServerProcess(name, command, port, scratch / f"{port}.log", cwd=cwd)
    cleanup.callback(server.stop)
    server.start()
    server.wait_healthy(client)
    return server


def model_id_of(client: httpx.Client, server: ServerProcess) -> str:
    return client.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]


def before_worktree(commit: str, cleanup: contextlib.ExitStack) -> Path:
    """The tree at `commit`, checked out beside this one (removed afterwards)."""
    path = Path(tempfile.gettempdir()) / f"tandem-before-{commit}"
    if not path.exists():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit],
            check=True, capture_output=True,
        )  # fmt: skip
        cleanup.callback(
            subprocess.run,
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
            check=False,
            capture_output=True,
        )
    return path


def measure(
    contenders: dict[str, Contender], streams: tuple[int, ...], rounds: int
) -> dict[str, dict[int, list[Burst]]]:
    results: dict[str, dict[int, list[Burst]]] = {n: {c: [] for c in streams} for n in contenders}

    async def all_rounds() -> None:
        for name, run in contenders.items():  # warm-up bursts, one retried: a server's
            try:  # listen backlog can reset a connection of the very first burst
                await run(streams[-1])
            except httpx.HTTPError as error:
                print(f"warm-up of {name} failed ({error!r}); once more", flush=True)
                await run(streams[-1])
        for round_index in range(rounds):
            for count in streams:
                for name, run in contenders.items():
                    try:
                        burst = await run(count)
                    except httpx.HTTPError as error:
                        raise RuntimeError(f"{name} at {count} streams: {error!r}") from error
                    results[name][count].append(burst)
                    print(
                        f"round {round_index + 1}/{rounds} {name} x{count}: "
                        f"{burst.tokens_per_s:.1f} tok/s",
                        flush=True,
                    )

    asyncio.run(all_rounds())
    return results


def rate(bursts: list[Burst]) -> float:
    return statistics.median(burst.tokens_per_s for burst in bursts)


def spread(bursts: list[Burst]) -> str:
    rates = [burst.tokens_per_s for burst in bursts]
    return f"{min(rates):.0f}-{max(rates):.0f}"


def ratio_spread(ours: list[Burst], theirs: list[Burst]) -> str:
    """Round-by-round ratios (each round ran both): median and range."""
    ratios = [a.tokens_per_s / b.tokens_per_s for a, b in zip(ours, theirs, strict=True)]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def gaps_ms(bursts: list[Burst]) -> tuple[float, float]:
    gaps = [gap for burst in bursts for gap in burst.gaps_s]
    return percentile(gaps, 0.5) * 1000, percentile(gaps, 0.99) * 1000


def render_tiny(tiny: dict[str, dict[int, list[Burst]]], before: str) -> str:
    process, thread, old = "core apart (process)", "one process (thread)", f"before ({before})"
    rows = []
    for count in TINY_STREAMS:
        row = [str(count)]
        for name in (process, thread, old):
            row.append(f"{rate(tiny[name][count]):.1f} ({spread(tiny[name][count])})")
        row.append(ratio_spread(tiny[process][count], tiny[old][count]))
        row.append(ratio_spread(tiny[process][count], tiny[thread][count]))
        rows.append(row)
    latency_rows = []
    for name in (process, thread, old):
        p50, p99 = gaps_ms(tiny[name][TINY_STREAMS[-1]])
        latency_rows.append([name, f"{p50:.1f}", f"{p99:.1f}"])
    header = [
        "streams", "core apart tok/s", "thread tok/s", "before tok/s", "apart / before",
        "apart / thread",
    ]  # fmt: skip
    return "\n".join(
        [
            f"**The 4-layer demo model** (`--model demo`), {MAX_TOKENS} tokens per stream, "
            "greedy, `--max-batch 64`: aggregate tok/s of the engine core in its own process "
            "(the default), on a thread of serve (`--engine-core thread`), and the code "
            f"before the split ({before}); ratios are per round.",
            "",
            markdown_table(header, rows),
            "",
            f"Inter-token latency at {TINY_STREAMS[-1]} streams (ms, every gap of every stream):",
            "",
            markdown_table(["server", "p50", "p99"], latency_rows),
        ]
    )


def render_versus(versus: dict[str, dict[int, list[Burst]]]) -> str:
    server, ours = "mlx_lm.server (MKL)", "tandem (core apart)"
    rows = [
        [
            str(count),
            f"{rate(versus[ours][count]):.1f} ({spread(versus[ours][count])})",
            f"{rate(versus[server][count]):.1f} ({spread(versus[server][count])})",
            ratio_spread(versus[ours][count], versus[server][count]),
        ]
        for count in SERVER_STREAMS
    ]
    return "\n".join(
        [
            "**Against mlx_lm.server** on the same BLAS (MKL preloaded for it): the 8-layer "
            f"hidden-512 demo, temperature 0.8, no seed (so it batches), {MAX_TOKENS} tokens "
            "per stream.",
            "",
            markdown_table(
                ["streams", "tandem tok/s", "mlx_lm.server tok/s", "tandem / server"], rows
            ),
        ]
    )


def cpu_split(server: ServerProcess, run: Contender, count: int) -> dict[str, float]:
    """Cores each process used over three bursts of `count` streams: serve's own process (the
    API process, when the core runs apart), its engine core if any, and this client."""
    serve = psutil.Process(server.pid)
    processes = {"serve": serve}
    for child in serve.children():
        if "engines.core.core_main" in " ".join(child.cmdline()):
            processes["core"] = child
    me = psutil.Process()

    def seconds() -> dict[str, float]:
        spent = {name: sum(p.cpu_times()[:2]) for name, p in processes.items()}
        return spent | {"client": sum(me.cpu_times()[:2])}

    before, started = seconds(), time.perf_counter()
    tokens = sum(asyncio.run(run(count)).tokens for _ in range(3))
    wall, after = time.perf_counter() - started, seconds()
    return {name: (after[name] - before[name]) / wall for name in after} | {
        "tok/s": tokens / wall
    }


def render_cpu(split: dict[str, dict[str, float]]) -> str:
    rows = [
        [
            name,
            f"{cores['tok/s']:.0f}",
            f"{cores['serve']:.2f}",
            f"{cores['core']:.2f}" if "core" in cores else "—",
            f"{cores['client']:.2f}",
        ]
        for name, cores in split.items()
    ]
    header = ["server", "tok/s", "serve (API) cores", "engine core cores", "client cores"]
    return (
        f"Where the CPU goes at {TINY_STREAMS[-1]} streams (three more bursts each, after the "
        "rounds; cores = CPU seconds per second of wall time, user + system):\n\n"
        + markdown_table(header, rows)
    )


def measure_tiny(rounds: int, before: str, scratch: Path, cleanup: contextlib.ExitStack,
                 client: httpx.Client) -> tuple[dict[str, dict[int, list[Burst]]],
                                                dict[str, dict[str, float]]]:  # fmt: skip
    model = ensure_demo_model(MODEL_CACHE, DemoSpec())
    batch = ["--max-batch", "64", "--queue-size", "64"]
    old_tree = before_worktree(before, cleanup)
    servers = {
        "core apart (process)": tandem("process", model, scratch, cleanup, client, batch),
        "one process (thread)": tandem(
            "thread", model, scratch, cleanup, client, [*batch, "--engine-core", "thread"]
        ),
        f"before ({before})": tandem("before", model, scratch, cleanup, client, batch, old_tree),
    }
    contenders = {
        name: http_contender(server.base_url, model_id_of(client, server), 0.0)
        for name, server in servers.items()
    }
    try:
        results = measure(contenders, TINY_STREAMS, rounds)
        split = {
            name: cpu_split(servers[name], contenders[name], TINY_STREAMS[-1])
            for name in servers
        }
        return results, split
    finally:
        for server in servers.values():
            server.stop()


def measure_versus(rounds: int, scratch: Path, cleanup: contextlib.ExitStack,
                   client: httpx.Client) -> dict[str, dict[int, list[Burst]]]:  # fmt: skip
    from engines.core.blas import activate

    model = ensure_demo_model(MODEL_CACHE, MODEL)
    ours = tandem("versus", model, scratch, cleanup, client, [])
    port = free_port(HOST)
    mlx_server = ServerProcess(
        "mlx_lm.server",
        mlx_server_command(model, port),
        port,
        scratch / "mlx-server.log",
        dict(os.environ, LD_PRELOAD=activate().path),
    )
    cleanup.callback(mlx_server.stop)
    mlx_server.start()
    mlx_server.wait_healthy(client)
    contenders = {
        "tandem (core apart)": http_contender(ours.base_url, model_id_of(client, ours), 0.8),
        "mlx_lm.server (MKL)": http_contender(mlx_server.base_url, None, 0.8),
    }
    return measure(contenders, SERVER_STREAMS, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", default=BEFORE, help="the commit to compare against")
    parser.add_argument("--no-write", action="store_true", help="print, do not write the doc")
    parser.add_argument(
        "--part", choices=("both", "tiny", "versus"), default="both",
        help="which part to run (one part alone is printed, not written)",
    )  # fmt: skip
    args = parser.parse_args()
    parts = [f"`{COMMAND}` — {args.rounds} interleaved rounds, medians (range); "
             f"{describe_machine()}."]  # fmt: skip
    with contextlib.ExitStack() as cleanup:
        scratch = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="tandem-core-")))
        client = cleanup.enter_context(httpx.Client(trust_env=False))
        if args.part in ("both", "tiny"):
            tiny, split = measure_tiny(args.rounds, args.before, scratch, cleanup, client)
            parts += [render_tiny(tiny, args.before), render_cpu(split)]
        if args.part in ("both", "versus"):
            parts.append(render_versus(measure_versus(args.rounds, scratch, cleanup, client)))
    body = "\n\n".join(parts)
    print(body)
    if args.part == "both" and not args.no_write:
        write_section(HEADING, body)


if __name__ == "__main__":
    main()
