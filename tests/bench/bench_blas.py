"""Linux CPU speed: tandem on its optimized BLAS vs mlx_lm.server and raw mlx-lm as installed.

Run from the project root: `python -m tests.bench.bench_blas` (a few minutes). For a float32
and a bfloat16 demo model (8 layers, hidden 512): time to first token of a 1,024-token prompt
(prefill) and the decode rate after it, for tandem serve over HTTP (MKL, bfloat16 upcast to
float32), `mlx_lm.server` over HTTP and raw `mlx_lm.stream_generate` in a process of its own
(both as installed: mlx's reference BLAS), and tandem with `--blas reference --cpu-float32
off` (the old behaviour). Writes "## Linux CPU speed (BLAS)" in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from engines.model.demo import ensure_demo_model
from engines.model.demo_spec import DemoSpec
from tests.bench.bench_single import MODEL_CACHE, ServerProcess, mlx_server_command, tandem_command
from tests.bench.common import free_port, markdown_table, write_section

HOST = "127.0.0.1"
PROMPT_TOKENS = 1024
DECODE_TOKENS = 64
ROUNDS = 3
HEADING = "## Linux CPU speed (BLAS)"
COMMAND = "python -m tests.bench.bench_blas"
RAW_SCRIPT = """
import json, sys, time
from mlx_lm import load, stream_generate
model, tokenizer = load(sys.argv[1])
prompt = tokenizer.encode(sys.argv[2])
for response in stream_generate(model, tokenizer, prompt[:16], max_tokens=8):
    pass  # warm-up
for _ in range({rounds}):
    started = time.perf_counter(); first = None
    for response in stream_generate(model, tokenizer, prompt, max_tokens={decode}):
        first = first or time.perf_counter()
    print(json.dumps([first - started, response.generation_tps]), flush=True)
"""


def long_prompt(model: Path) -> str:
    """A text of about PROMPT_TOKENS tokens for this model's tokenizer (the same for all)."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model)
    words = " ".join(f"w{i % 97} item {i}" for i in range(PROMPT_TOKENS))
    return tokenizer.decode(tokenizer.encode(words)[1 : PROMPT_TOKENS + 1])


def stream_once(
    client: httpx.Client, base_url: str, model_id: str | None, prompt: str
) -> tuple[float, float]:
    """(time to first token, decode tok/s) of one streamed completion of the long prompt."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": DECODE_TOKENS,
        "temperature": 0.0,
        "stream": True,
    }
    if model_id:
        body["model"] = model_id
    stamps = []
    started = time.perf_counter()
    with client.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[len("data: ") :]).get("choices") or []
                if any(choice.get("text") for choice in choices):
                    stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"{base_url} streamed {len(stamps)} chunks")
    return stamps[0] - started, (len(stamps) - 1) / (stamps[-1] - stamps[0])


def measure_server(
    server: ServerProcess, rounds: int, with_model: bool, prompt: str
) -> list[tuple[float, float]]:
    with httpx.Client(trust_env=False) as client:
        server.wait_healthy(client)
        model_id = None
        if with_model:
            model_id = client.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
        stream_once(client, server.base_url, model_id, prompt[:200])  # warm-up, short
        return [stream_once(client, server.base_url, model_id, prompt) for _ in range(rounds)]


def measure_raw(model: Path, rounds: int, prompt: str) -> list[tuple[float, float]]:
    script = RAW_SCRIPT.format(rounds=rounds, decode=DECODE_TOKENS)
    output = subprocess.run(
        [sys.executable, "-c", script, str(model), prompt],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if output.returncode != 0:
        raise RuntimeError(output.stderr[-2000:])
    return [tuple(json.loads(line)) for line in output.stdout.splitlines()]


def run_contenders(model: Path, rounds: int, scratch: Path) -> dict[str, list[tuple[float, float]]]:
    prompt = long_prompt(model)
    results = {"raw mlx_lm.stream_generate (as installed)": measure_raw(model, rounds, prompt)}
    servers = {
        "tandem serve (MKL, float32 compute)": (tandem_command, [], True),
        "tandem serve --blas reference --cpu-float32 off": (
            tandem_command,
            ["--blas", "reference", "--cpu-float32", "off"],
            True,
        ),
        "mlx_lm.server (as installed)": (None, [], False),
    }
    for name, (builder, extra, ours) in servers.items():
        port = free_port(HOST)
        if ours:
            command = builder(model, port, scratch) + extra
        else:
            command = mlx_server_command(model, port)
        server = ServerProcess(name, command, port, scratch / f"{port}.log")
        server.start()
        try:
            results[name] = measure_server(server, rounds, ours, prompt)
        finally:
            server.stop()
    return results


def render(tables: dict[str, dict[str, list[tuple[float, float]]]], rounds: int) -> str:
    rows = []
    for dtype, results in tables.items():
        server = results["mlx_lm.server (as installed)"]
        server_ttft = statistics.median(s[0] for s in server)
        server_rate = statistics.median(s[1] for s in server)
        for name, samples in results.items():
            ttft = statistics.median(s[0] for s in samples)
            rate = statistics.median(s[1] for s in samples)
            rows.append(
                [
                    dtype,
                    name,
                    f"{ttft:.2f}",
                    f"{server_ttft / ttft:.1f}x",
                    f"{rate:.1f}",
                    f"{rate / server_rate:.2f}x",
                ]
            )
    header = ["model", "contender", "TTFT s", "prefill vs server", "decode tok/s", "vs server"]
    setup = (
        f"Demo model 8 layers x hidden 512, {PROMPT_TOKENS}-token prompt, {DECODE_TOKENS} tokens "
        f"greedy; medians of {rounds} run(s) after a short warm-up, one contender at a time. "
        "Targets: "
        "tandem decode >= 1.5x mlx_lm.server, prefill >= 5x faster."
    )
    return "\n\n".join([setup, markdown_table(header, rows).rstrip()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--no-write", action="store_true")
    arguments = parser.parse_args()
    tables = {}
    with contextlib.ExitStack() as cleanup:
        scratch = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="tandem-blas-")))
        for dtype in ("float32", "bfloat16"):
            spec = DemoSpec(layers=8, hidden=512, heads=8, kv_heads=4, vocab=1024, dtype=dtype)
            model = ensure_demo_model(MODEL_CACHE, spec)
            tables[dtype] = run_contenders(model, arguments.rounds, scratch)
            print(f"{dtype} done", file=sys.stderr)
    command = " ".join([COMMAND, *sys.argv[1:]])
    body = render(tables, arguments.rounds) + f"\n\nCommand: `{command}`"
    sys.stdout.write(body + "\n")
    if not arguments.no_write:
        write_section(HEADING, body)


if __name__ == "__main__":
    main()
