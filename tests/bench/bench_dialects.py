"""Each API dialect's streaming cost beside chat completions': one `tandem serve`, 8 streams.

Run from the project root: `python -m tests.bench.bench_dialects` (about two minutes). One
server on the tiny 4-layer demo model (so the API's share of each token is as large as it
gets); in interleaved rounds, each dialect streams 8 concurrent greedy generations of the
same length. It reports the aggregate tokens/s and the serve process's CPU milliseconds per
streamed token, medians over the rounds, as ratios to chat completions, and writes them to
docs/benchmarks.md under "## API dialects".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from engines.model.demo import ensure_demo_model
from engines.model.demo_spec import DemoSpec
from tests.bench.common import cpu_seconds, free_port, markdown_table, write_section

HOST = "127.0.0.1"
MODEL = DemoSpec()  # the default 4-layer demo model
MODEL_ID = "bench"
MODEL_CACHE = Path(tempfile.gettempdir()) / "tandem-bench"
STREAMS = 8
MAX_TOKENS = 96
ROUNDS = 7
TARGET = 0.95  # each dialect's tok/s at least this share of chat completions'
HEADING = "## API dialects"
COMMAND = "python -m tests.bench.bench_dialects"
PROMPT = "Tell me a long story about the sea."


def chat_body(index: int) -> dict[str, Any]:
    return {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": f"{PROMPT} ({index})"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def messages_body(index: int) -> dict[str, Any]:
    return {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": f"{PROMPT} ({index})"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }


def responses_body(index: int) -> dict[str, Any]:
    return {
        "model": MODEL_ID,
        "input": f"{PROMPT} ({index})",
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "store": False,
    }


def ollama_body(index: int) -> dict[str, Any]:
    return {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": f"{PROMPT} ({index})"}],
        "options": {"num_predict": MAX_TOKENS, "temperature": 0},
        "stream": True,
    }


def sse_payloads(line: str) -> dict[str, Any] | None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line.removeprefix("data: "))


def chat_tokens(payload: dict[str, Any]) -> int | None:
    usage = payload.get("usage")
    return usage["completion_tokens"] if usage else None


def messages_tokens(payload: dict[str, Any]) -> int | None:
    if payload.get("type") == "message_delta":
        return payload["usage"]["output_tokens"]
    return None


def responses_tokens(payload: dict[str, Any]) -> int | None:
    if payload.get("type") in ("response.completed", "response.incomplete"):
        return payload["response"]["usage"]["output_tokens"]
    return None


def ollama_tokens(payload: dict[str, Any]) -> int | None:
    return payload.get("eval_count") if payload.get("done") else None


DIALECTS: dict[str, tuple[str, Callable, Callable, bool]] = {
    # name: (path, body, tokens from a payload, SSE (else NDJSON))
    "chat completions": ("/v1/chat/completions", chat_body, chat_tokens, True),
    "Anthropic Messages": ("/v1/messages", messages_body, messages_tokens, True),
    "OpenAI Responses": ("/v1/responses", responses_body, responses_tokens, True),
    "Ollama /api/chat": ("/api/chat", ollama_body, ollama_tokens, False),
}


async def stream_one(client: httpx.AsyncClient, dialect: str, index: int) -> int:
    """One streamed generation; the tokens its final usage reports."""
    path, body, tokens_of, sse = DIALECTS[dialect]
    async with client.stream("POST", path, json=body(index)) as response:
        response.raise_for_status()
        tokens = None
        async for line in response.aiter_lines():
            payload = sse_payloads(line) if sse else (json.loads(line) if line else None)
            if payload is not None:
                tokens = tokens_of(payload) or tokens
    if not tokens:
        raise RuntimeError(f"{dialect}: no token count in the stream")
    return tokens


def measure(base_url: str, dialect: str, pid: int) -> tuple[float, float]:
    """(aggregate tokens/s, server CPU ms per token) of STREAMS concurrent streams."""

    async def run_all() -> int:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            counts = await asyncio.gather(
                *(stream_one(client, dialect, index) for index in range(STREAMS))
            )
        return sum(counts)

    cpu_before = cpu_seconds([pid])
    started = time.perf_counter()
    tokens = asyncio.run(run_all())
    elapsed = time.perf_counter() - started
    cpu_after = cpu_seconds([pid])
    server_cpu = (cpu_after - cpu_before) if cpu_before is not None and cpu_after else 0.0
    return tokens / elapsed, server_cpu * 1e3 / tokens


def start_server(model_dir: Path, port: int) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "cli.main", "serve", "--model", str(model_dir),
        "--model-id", MODEL_ID, "--host", HOST, "--port", str(port), "--interface", HOST,
        "--parallelism", "single", "--max-batch", str(STREAMS), "--measure-speeds", "off",
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_healthy(base_url: str, process: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"serve exited with {process.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError("serve did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--no-write", action="store_true", help="print, do not touch docs")
    args = parser.parse_args()
    model_dir = ensure_demo_model(MODEL_CACHE, MODEL)
    port = free_port()
    base_url = f"http://{HOST}:{port}"
    process = start_server(model_dir, port)
    try:
        wait_healthy(base_url, process)
        names = list(DIALECTS)
        for name in names:  # warm-up
            measure(base_url, name, process.pid)
        rates: dict[str, list[float]] = {name: [] for name in names}
        costs: dict[str, list[float]] = {name: [] for name in names}
        for index in range(args.rounds):
            for name in names[index % len(names) :] + names[: index % len(names)]:
                rate, cost = measure(base_url, name, process.pid)
                rates[name].append(rate)
                costs[name].append(cost)
    finally:
        process.terminate()
        process.wait(30)
    base_rate = statistics.median(rates["chat completions"])
    base_cost = statistics.median(costs["chat completions"])
    rows = []
    for name in names:
        rate, cost = statistics.median(rates[name]), statistics.median(costs[name])
        spread = f"{min(rates[name]):.0f}-{max(rates[name]):.0f}"
        rows.append(
            [name, f"{rate:.0f}", spread, f"{rate / base_rate:.2f}x", f"{cost:.2f}",
             f"{cost / base_cost:.2f}x"]
        )  # fmt: skip
    header = ["dialect", "tok/s (median)", "spread", "vs chat", "serve CPU ms/token", "vs chat"]
    table = markdown_table(header, rows)
    body = (
        f"`{COMMAND}`: one `tandem serve` (single engine, the 4-layer demo model), "
        f"{STREAMS} concurrent greedy streams of {MAX_TOKENS} tokens per dialect, "
        f"{args.rounds} interleaved rounds; medians, and the spread of tok/s over the rounds. "
        "Serve CPU is the server process's user+system time per streamed token (the API's "
        "framing, detokenizing and the model together).\n\n" + table
    )
    print(body)
    if not args.no_write:
        write_section(HEADING, body)


if __name__ == "__main__":
    main()
