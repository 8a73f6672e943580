"""Single-node benchmark: raw mlx-lm vs tandem's engine, tandem over HTTP, and mlx_lm.server.

Run from the project root: `python -m tests.bench.bench_single` (one to two minutes). Every
contender decodes the same prompt greedily to the same length on the same demo model, in
interleaved rounds; it prints a markdown table and writes it to docs/benchmarks.md under
"## Single node".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.model.demo import ensure_demo_model
from engines.model.demo_spec import DemoSpec
from engines.single.engine import SingleEngine
from tests.bench.common import (
    Sample,
    cpu_ms_per_token,
    free_port,
    markdown_table,
    median_of,
    run_interleaved,
    sample_from_stamps,
    with_cpu,
    write_section,
)

HOST = "127.0.0.1"
MODEL = DemoSpec(layers=8, hidden=512, heads=8, kv_heads=4, vocab=1024)
MODEL_CACHE = Path(tempfile.gettempdir()) / "tandem-bench"
PROMPT = "The single node benchmark measures how fast one machine decodes tokens."
MAX_TOKENS = 128
ROUNDS = 9
STARTUP_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 120.0
DECODE_TARGET = 0.97  # tandem over HTTP must reach this share of raw mlx-lm decode speed
HEADING = "## Single node"
COMMAND = "python -m tests.bench.bench_single"

RAW = "mlx_lm.stream_generate (in-process)"
ENGINE = "tandem EngineRunner + SingleEngine (in-process)"
TANDEM_HTTP = "tandem serve, HTTP /v1/completions"
MLX_HTTP = "mlx_lm.server, HTTP /v1/completions"


def time_raw(model: Any, tokenizer: Any, prompt: list[int], max_tokens: int) -> Sample:
    """mlx-lm's own streaming generator, greedy (its default sampler is argmax)."""
    from mlx_lm import stream_generate

    stamps: list[float] = []
    started = time.perf_counter()
    for _ in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        stamps.append(time.perf_counter())
    return sample_from_stamps(started, stamps[0], stamps[-1], len(stamps))


class EngineContender:
    """tandem's runner thread and engine in this process, consumed the way the API does."""

    def __init__(self, model_path: Path) -> None:
        self.runner = EngineRunner(SingleEngine(model_path))
        self.loop = asyncio.new_event_loop()

    def start(self) -> None:
        self.runner.start(load_timeout_s=STARTUP_TIMEOUT_S)

    def measure(self, prompt: list[int], max_tokens: int) -> Sample:
        return self.loop.run_until_complete(self._generate(prompt, max_tokens))

    async def _generate(self, prompt: list[int], max_tokens: int) -> Sample:
        request = GenerationRequest("bench", tuple(prompt), max_tokens=max_tokens)
        started = time.perf_counter()
        submission = self.runner.submit(request)
        first = None
        async for event in submission.events():
            now = time.perf_counter()
            if event.token is not None and first is None:
                first = now
            if event.finish_reason == "length":
                return sample_from_stamps(started, first, now, event.completion_tokens)
            if event.finish_reason is not None:
                raise RuntimeError(f"engine generation ended with {event.finish_reason}")
        raise RuntimeError("the engine's event stream ended without a final event")

    def close(self) -> None:
        self.runner.close()
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()


class ServerProcess:
    """A server started as a subprocess, logging to a file, stopped by its own PID."""

    def __init__(
        self,
        name: str,
        command: list[str],
        port: int,
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.cwd = cwd  # None: this process's
        self.command = command
        self.env = env  # None: this process's environment
        self.base_url = f"http://{HOST}:{port}"
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "wb") as log_file:
            self.process = subprocess.Popen(
                self.command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
            )

    def wait_healthy(self, client: httpx.Client, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.log_tail()}")
            try:
                if client.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not healthy within {timeout_s:g} s:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.process.pid

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


def time_stream(client: httpx.Client, url: str, body: dict[str, Any]) -> Sample:
    """TTFT = first chunk with text; decode = tokens after it until the finish chunk.

    Lines are only stamped while streaming and parsed afterwards, so the client takes as
    little CPU as it can from the server it measures (two cores are all there is).
    """
    arrivals: list[tuple[float, str]] = []
    started = time.perf_counter()
    with client.stream("POST", url, json=body, timeout=REQUEST_TIMEOUT_S) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{url} answered {response.status_code}: {response.text}")
        for line in response.iter_lines():
            arrivals.append((time.perf_counter(), line))
    first = last = None
    tokens = text_chunks = 0
    for arrived, line in arrivals:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: ") :])
        if "error" in chunk:
            raise RuntimeError(f"{url} streamed an error: {chunk['error']}")
        for choice in chunk.get("choices") or []:
            if choice.get("text"):
                text_chunks += 1
                first = arrived if first is None else first
            if choice.get("finish_reason"):
                last = arrived
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    if first is None or last is None:
        raise RuntimeError(f"{url} streamed no text or no finish chunk")
    return sample_from_stamps(started, first, last, tokens or text_chunks)


def tandem_command(model: Path, port: int, scratch: Path) -> list[str]:
    tandem = Path(sys.executable).with_name("tandem")
    launcher = [str(tandem)] if tandem.exists() else [sys.executable, "-m", "cli.main"]
    return launcher + [
        "serve", "--parallelism", "single", "--model", str(model),
        "--host", HOST, "--port", str(port), "--interface", HOST,
        "--state-dir", str(scratch / "state"), "--cache-dir", str(scratch / "cache"),
    ]  # fmt: skip


def mlx_server_command(model: Path, port: int) -> list[str]:
    # No prompt cache: it would reuse the repeated prompt's KV and shortcut its TTFT.
    return [
        sys.executable, "-m", "mlx_lm", "server", "--model", str(model),
        "--host", HOST, "--port", str(port), "--prompt-cache-size", "0",
        "--log-level", "WARNING",
    ]  # fmt: skip


def completion_body(model_id: str | None, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model_id is not None:
        body["model"] = model_id
    return body


def measure_all(model_path: Path, rounds: int, max_tokens: int) -> dict[str, list[Sample]]:
    """Load all four contenders at once, then time them in interleaved rounds."""
    from mlx_lm import load

    with contextlib.ExitStack() as cleanup:
        scratch = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="tandem-bench-")))
        tandem_port, mlx_port = free_port(HOST), free_port(HOST)
        tandem = ServerProcess(
            "tandem serve",
            tandem_command(model_path, tandem_port, scratch),
            tandem_port,
            scratch / "tandem.log",
        )
        mlx_server = ServerProcess(
            "mlx_lm.server", mlx_server_command(model_path, mlx_port), mlx_port, scratch / "mlx.log"
        )
        # Unwound in reverse: the servers are stopped even if a later step fails.
        for server in (tandem, mlx_server):
            cleanup.callback(server.stop)
            server.start()
        client = cleanup.enter_context(httpx.Client(trust_env=False))
        model, tokenizer = load(str(model_path))
        prompt = tokenizer.encode(PROMPT)
        engine = EngineContender(model_path)
        engine.start()
        cleanup.callback(engine.close)
        tandem.wait_healthy(client)
        mlx_server.wait_healthy(client)
        model_id = client.get(f"{tandem.base_url}/v1/models").json()["data"][0]["id"]
        tandem_body = completion_body(model_id, max_tokens)
        mlx_body = completion_body(None, max_tokens)
        contenders: dict[str, Callable[[], Sample]] = {
            RAW: with_cpu(lambda: time_raw(model, tokenizer, prompt, max_tokens)),
            ENGINE: with_cpu(lambda: engine.measure(prompt, max_tokens)),
            TANDEM_HTTP: with_cpu(
                lambda: time_stream(client, f"{tandem.base_url}/v1/completions", tandem_body),
                [tandem.pid],
            ),
            MLX_HTTP: with_cpu(
                lambda: time_stream(client, f"{mlx_server.base_url}/v1/completions", mlx_body),
                [mlx_server.pid],
            ),
        }
        return run_interleaved(contenders, rounds)


def render(samples: dict[str, list[Sample]], rounds: int, max_tokens: int, command: str) -> str:
    def decode_rate(name: str) -> float:
        return median_of(samples[name], lambda s: s.decode_tokens_per_s)

    raw_rate = decode_rate(RAW)
    rows = [
        [
            name,
            f"{decode_rate(name):.1f}",
            f"{max(s.decode_tokens_per_s for s in runs):.1f}",
            f"{median_of(runs, lambda s: s.first_token_s) * 1e3:.1f}",
            f"{decode_rate(name) / raw_rate:.3f}",
            cpu_ms_per_token(runs),
            "/".join(str(count) for count in sorted({s.tokens for s in runs})),
        ]
        for name, runs in samples.items()
    ]
    header = [
        "contender", "decode tok/s (median)", "best", "TTFT ms (median)", "vs raw decode",
        "CPU ms / token", "tokens",
    ]  # fmt: skip
    to_raw = decode_rate(TANDEM_HTTP) / raw_rate
    to_mlx = decode_rate(TANDEM_HTTP) / decode_rate(MLX_HTTP)
    verdicts = [
        f"- tandem over HTTP / raw decode: {to_raw:.3f} (target >= {DECODE_TARGET}: "
        f"{'met' if to_raw >= DECODE_TARGET else 'missed'})",
        f"- tandem over HTTP / mlx_lm.server decode: {to_mlx:.3f} (target >= 1: "
        f"{'met' if to_mlx >= 1 else 'missed'})",
    ]
    setup = (
        f"Demo model: llama, {MODEL.layers} layers, hidden {MODEL.hidden}, {MODEL.heads} heads, "
        f"{MODEL.kv_heads} kv heads, vocab {MODEL.vocab}, {MODEL.dtype}. The same "
        f"{len(PROMPT.split())}-word prompt everywhere, greedy, {max_tokens} tokens. One warm-up "
        f"each, then {rounds} interleaved rounds (each round starts one contender later); "
        "medians (best: the fastest round; other load only ever slows a round down). TTFT: "
        "request start to the first token (the first text chunk over HTTP). "
        "Decode tok/s: (tokens - 1) / (final chunk - first token). HTTP contenders are "
        "streamed with httpx from the benchmark process; mlx_lm.server runs with "
        "`--prompt-cache-size 0` so it cannot reuse the repeated prompt's KV cache. CPU ms / "
        "token: user + system time of the benchmark process (plus the server, over HTTP) per "
        "token, prefill included; less sensitive than wall time to other load on the machine."
    )
    caveat = (
        "With other work on the machine a round can lose 20% of its speed, so medians move by "
        "a few percent from run to run and a target can flip between met and missed; the best "
        "column and CPU ms / token are the steadier comparisons."
    )
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    table = markdown_table(header, rows)
    footer = f"Command: `{command}` (run {date})"
    return "\n".join([setup, "", table, *verdicts, "", caveat, "", footer, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved timed rounds")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="tokens per request")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs alone")
    arguments = parser.parse_args()
    model_path = ensure_demo_model(MODEL_CACHE, MODEL)
    samples = measure_all(model_path, arguments.rounds, arguments.max_tokens)
    command = " ".join([COMMAND, *sys.argv[1:]])
    body = render(samples, arguments.rounds, arguments.max_tokens, command)
    sys.stdout.write(body)
    if not arguments.no_write:
        write_section(HEADING, body)


if __name__ == "__main__":
    main()
