"""Draft-model speculation (--draft-model) against mlx_lm.server --draft-model, the same pair on
the same BLAS: one greedy stream's decode tok/s over HTTP, side by side in interleaved rounds.

The only real model here is SmolLM2-135M-Instruct, so the pair is its Q4_1 import (mlx 4-bit)
drafting for its float32 import: a pair that accepts optimistically (the same model), and on
this CPU a slow one (mlx's quantized matmul has no BLAS path: the draft is not cheaper than the
target). tandem without speculation is the third contender, for the cost of drafting itself.

Run from the project root: `python -m tests.bench.bench_draft_model` (a few minutes). It writes
docs/benchmarks.md's "## Draft-model speculation" section.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from discovery.framing import free_port
from engines.core.blas import activate
from engines.model.gguf.cache import ensure_imported
from tests.bench.bench_single import HOST, ServerProcess, tandem_command, time_stream
from tests.bench.common import Sample, markdown_table, run_interleaved, write_section
from tests.helpers.smollm2 import smollm2_gguf

HEADING = "## Draft-model speculation"
COMMAND = "python -m tests.bench.bench_draft_model"
DRAFTED = 3  # mlx_lm.server's default --num-draft-tokens; both servers use it
ROUNDS = 5
MAX_TOKENS = 64
PROMPT = "The history of the lighthouse begins"
PLAIN, OURS, THEIRS = (
    "tandem, no speculation",
    "tandem --draft-model",
    "mlx_lm.server --draft-model",
)


def body(model: str | None) -> dict:
    found = {
        "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    return found if model is None else {**found, "model": model}


def main() -> None:
    cache = Path.home() / ".cache" / "tandem"
    target = ensure_imported(smollm2_gguf(), cache, dequantize=True)
    draft = ensure_imported(smollm2_gguf(), cache, dequantize=False)
    mkl = activate().path
    with contextlib.ExitStack() as cleanup:
        scratch = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="tandem-bench-")))
        servers = {}
        for name, extra in ((PLAIN, ["--num-draft-tokens", "0"]),
                            (OURS, ["--draft-model", str(draft),
                                    "--num-draft-tokens", str(DRAFTED)])):  # fmt: skip
            port = free_port(HOST)
            command = tandem_command(target, port, scratch / name.split()[1]) + extra
            command[: command.index("serve")] = [sys.executable, "-m", "cli.main"]  # this tree
            servers[name] = ServerProcess(name, command, port, scratch / f"{len(servers)}.log")
        port = free_port(HOST)
        theirs = [
            sys.executable, "-m", "mlx_lm", "server", "--model", str(target),
            "--draft-model", str(draft), "--num-draft-tokens", str(DRAFTED),
            "--host", HOST, "--port", str(port), "--prompt-cache-size", "0",
            "--log-level", "WARNING",
        ]  # fmt: skip
        env = dict(os.environ, LD_PRELOAD=mkl) if mkl else None
        servers[THEIRS] = ServerProcess(THEIRS, theirs, port, scratch / "mlx.log", env)
        for server in servers.values():
            cleanup.callback(server.stop)
            server.start()
        client = cleanup.enter_context(httpx.Client(trust_env=False))
        for server in servers.values():
            server.wait_healthy(client, 600)
        ids = {
            name: client.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
            for name, server in servers.items()
            if name != THEIRS
        }

        def streamer(server: ServerProcess, model: str | None):
            url = f"{server.base_url}/v1/completions"
            return lambda: time_stream(client, url, body(model))

        contenders = {name: streamer(server, ids.get(name)) for name, server in servers.items()}
        samples: dict[str, list[Sample]] = run_interleaved(contenders, ROUNDS)
    rates = {name: [s.decode_tokens_per_s for s in found] for name, found in samples.items()}
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratios = sorted(o / t for o, t in zip(rates[OURS], rates[THEIRS], strict=True))
    rows = [
        [name, f"{medians[name]:.1f}", f"{min(rates[name]):.1f}-{max(rates[name]):.1f}"]
        for name in (PLAIN, OURS, THEIRS)
    ]
    text = (
        f"`{COMMAND}`: SmolLM2-135M-Instruct's Q4_1 import (mlx 4-bit) drafting for its float32 "
        f"import, {DRAFTED} tokens per draft, one greedy stream of {MAX_TOKENS} tokens over HTTP "
        f"(/v1/completions), medians of {ROUNDS} interleaved rounds; mlx_lm.server with tandem's "
        "MKL preloaded. The pair is one model twice (it accepts optimistically), and on this CPU "
        "the 4-bit draft is no cheaper than the float target, so drafting costs here.\n\n"
        + markdown_table(["contender", "decode tok/s (median)", "range"], rows)
        + "\ntandem / mlx_lm.server with the same pair: "
        f"**{medians[OURS] / medians[THEIRS]:.2f}x** "
        f"(per-round {ratios[0]:.2f}-{ratios[-1]:.2f}).\n"
    )
    print(text)
    if "--no-write" not in sys.argv:
        write_section(HEADING, text)


if __name__ == "__main__":
    main()
