"""Concurrent streams: tandem's continuous batching against mlx_lm.server's, 1 to 16 streams.

Run from the project root: `python -m tests.bench.bench_batching` (several minutes). At each
concurrency N, N streaming completions with different prompts start at once; every contender
gets the same prompts, greedy, the same max_tokens. Reported per contender and N: aggregate
tokens/s (all completion tokens over the burst's wall time), time to first token and
inter-token latency (p50 / p95). mlx_lm.server gets no `seed`, so it batches. Contenders:
tandem serve (single) and mlx_lm.server over HTTP, tandem tp=2 (ring over loopback) and
pp=2 / pp=3 driven in-process through the same EngineRunner the API uses, and mlx-lm's own
`batch_generate` as the ceiling of this CPU. mlx_lm.server runs twice: as installed (mlx's
reference BLAS) and with tandem's MKL preloaded (`LD_PRELOAD`), the fair comparison.
`--temperature T` samples without a seed instead of greedy decoding. Writes "## Concurrent
streams" in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.model.demo import ensure_demo_model
from tests.bench.bench_single import (
    MODEL,
    MODEL_CACHE,
    ServerProcess,
    mlx_server_command,
    tandem_command,
)
from tests.bench.common import free_port, markdown_table, write_section

HOST = "127.0.0.1"
CONCURRENCY = (1, 2, 4, 8, 16)
MAX_TOKENS = 64
ROUNDS = 3
HEADING = "## Concurrent streams"
COMMAND = "python -m tests.bench.bench_batching"
REQUEST_TIMEOUT_S = 600.0
SERVER = "mlx_lm.server (HTTP)"  # as installed: mlx's reference BLAS
SERVER_MKL = "mlx_lm.server (HTTP, MKL preloaded)"
TEMPERATURE = 0.0  # --temperature; no request carries a seed, so mlx_lm.server batches


@dataclass(frozen=True, slots=True)
class Burst:
    """One burst of N concurrent streams."""

    wall_s: float
    tokens: int
    first_token_s: list[float]  # per stream
    gaps_s: list[float]  # every inter-token gap of every stream

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def prompts_for(count: int) -> list[str]:
    return [
        f"Stream {index} of the batching benchmark asks about topic {index * 7}."
        for index in range(count)
    ]


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def burst_from(started: float, ended: float, streams: list[tuple[list[float], int]]) -> Burst:
    """streams: (arrival stamps of text chunks, completion tokens) per stream."""
    gaps = [
        later - earlier
        for stamps, _ in streams
        for earlier, later in zip(stamps, stamps[1:], strict=False)
    ]
    firsts = [stamps[0] - started for stamps, _ in streams if stamps]
    return Burst(ended - started, sum(tokens for _, tokens in streams), firsts, gaps)


# -- over HTTP ----------------------------------------------------------------------------------


async def http_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[list[float], int]:
    stamps: list[float] = []
    lines: list[str] = []
    async with client.stream("POST", url, json=body, timeout=REQUEST_TIMEOUT_S) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{url} answered {response.status_code}: {response.text}")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
                lines.append(line)
    text_stamps, tokens = [], 0
    for stamp, line in zip(stamps, lines, strict=False):
        chunk = json.loads(line[len("data: ") :])
        if "error" in chunk:
            raise RuntimeError(f"{url} streamed an error: {chunk['error']}")
        if any(choice.get("text") for choice in chunk.get("choices") or []):
            text_stamps.append(stamp)
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return text_stamps, tokens


async def patient_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[list[float], int]:
    """A stream, retried when its connection is reset before it answers: mlx_lm.server's
    listen backlog (5) resets some of 16 connections opened at once."""
    for attempt in range(3):
        try:
            return await http_stream(client, url, body)
        except (httpx.ReadError, httpx.ConnectError, httpx.RemoteProtocolError):
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def http_contender(
    base_url: str, model_id: str | None, temperature: float | None = None
) -> Callable[[int], Awaitable[Burst]]:
    """N streams at once over HTTP; `temperature` None: --temperature's."""

    async def run(count: int) -> Burst:
        bodies = []
        for prompt in prompts_for(count):
            body: dict[str, Any] = {
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": TEMPERATURE if temperature is None else temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if model_id is not None:
                body["model"] = model_id
            bodies.append(body)
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(trust_env=False, limits=limits) as client:
            started = time.perf_counter()
            streams = await asyncio.gather(
                *(patient_stream(client, f"{base_url}/v1/completions", body) for body in bodies)
            )
            ended = time.perf_counter()
        return burst_from(started, ended, list(streams))

    return run


# -- in-process engines -------------------------------------------------------------------------


def runner_contender(runner: EngineRunner) -> Callable[[int], Awaitable[Burst]]:
    tokenizer = runner.engine.tokenizer

    async def one(prompt: str, index: int) -> tuple[list[float], int]:
        request = GenerationRequest(
            f"b{index}", tuple(tokenizer.encode(prompt)), MAX_TOKENS, temperature=TEMPERATURE
        )
        submission = runner.submit(request)
        stamps: list[float] = []
        async for event in submission.events():
            if event.token is not None:
                stamps.append(time.perf_counter())
            if event.finish_reason is not None:
                if event.finish_reason == "error":
                    raise RuntimeError(f"engine error: {event.error}")
                return stamps, event.completion_tokens
        raise RuntimeError("no final event")

    async def run(count: int) -> Burst:
        started = time.perf_counter()
        streams = await asyncio.gather(*(one(p, i) for i, p in enumerate(prompts_for(count))))
        return burst_from(started, time.perf_counter(), list(streams))

    return run


def raw_batch_contender(model_path: Path) -> Callable[[int], Awaitable[Burst]]:
    """mlx-lm's batch_generate: the whole batch at once, no server, no streaming."""
    from mlx_lm import batch_generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(model_path))
    sampler = make_sampler(temp=TEMPERATURE)

    async def run(count: int) -> Burst:
        prompts = [tokenizer.encode(p) for p in prompts_for(count)]
        started = time.perf_counter()
        response = batch_generate(
            model, tokenizer, prompts, max_tokens=MAX_TOKENS, sampler=sampler
        )
        ended = time.perf_counter()
        tokens = response.stats.generation_tokens
        return Burst(ended - started, tokens, [], [])

    return run


def measure_stall(runner: EngineRunner, long_prompt_tokens: int = 2000) -> tuple[float, float]:
    """(longest gap, median gap) in seconds of 4 running streams while a long prompt joins."""
    tokenizer = runner.engine.tokenizer
    filler = tokenizer.encode(" ".join(f"word{i}" for i in range(long_prompt_tokens)))
    long_prompt = tuple(filler[:long_prompt_tokens])

    async def stream(request: GenerationRequest, stamps: list[float]) -> None:
        async for event in runner.submit(request).events():
            if event.token is not None:
                stamps.append(time.perf_counter())

    async def run() -> tuple[float, float]:
        runners = [[] for _ in range(4)]
        tasks = [
            asyncio.create_task(
                stream(GenerationRequest(f"s{i}", tuple(tokenizer.encode(p)), 400), runners[i])
            )
            for i, p in enumerate(prompts_for(4))
        ]
        while min(len(stamps) for stamps in runners) < 20:
            await asyncio.sleep(0.01)
        joined = time.perf_counter()
        await stream(GenerationRequest("long", long_prompt, 1), [])
        prefilled = time.perf_counter()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        during = [
            later - earlier
            for stamps in runners
            for earlier, later in zip(stamps, stamps[1:], strict=False)
            if later >= joined and earlier <= prefilled
        ]
        before = [
            later - earlier
            for stamps in runners
            for earlier, later in zip(stamps, stamps[1:], strict=False)
            if later < joined
        ]
        return max(during), statistics.median(before)

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(run())
    finally:
        loop.close()


# -- the run ------------------------------------------------------------------------------------


failures: dict[str, dict[int, str]] = {}  # contender -> streams -> what went wrong


def measure(
    contenders: dict[str, Callable[[int], Awaitable[Burst]]], rounds: int
) -> dict[str, dict[int, list[Burst]]]:
    """Every contender at every concurrency, interleaved per round, one warm-up each."""
    results: dict[str, dict[int, list[Burst]]] = {name: {} for name in contenders}
    loop = asyncio.new_event_loop()
    failures.clear()
    try:
        for run in contenders.values():
            loop.run_until_complete(run(2))
        for count in CONCURRENCY:
            names = list(contenders)
            for index in range(rounds):
                for name in names[index % len(names) :] + names[: index % len(names)]:
                    try:
                        burst = loop.run_until_complete(contenders[name](count))
                    except (httpx.HTTPError, RuntimeError) as error:  # a contender that breaks
                        failures.setdefault(name, {})[count] = f"{type(error).__name__}: {error}"
                        print(f"{name} x{count}: failed: {error!r}", file=sys.stderr)
                        continue
                    results[name].setdefault(count, []).append(burst)
                    print(f"{name} x{count}: {burst.tokens_per_s:.1f} tok/s", file=sys.stderr)
    finally:
        loop.close()
    return results


def render(results: dict[str, dict[int, list[Burst]]], rounds: int, command: str) -> str:
    def rate(name: str, count: int) -> float:
        bursts = results[name].get(count)
        if not bursts:
            return float("nan")
        return statistics.median(burst.tokens_per_s for burst in bursts)

    rows = []
    for name, by_count in results.items():
        for count, bursts in by_count.items():
            best = max(bursts, key=lambda b: b.tokens_per_s)
            firsts = [v for b in bursts for v in b.first_token_s]
            gaps = [v for b in bursts for v in b.gaps_s]
            latency = (
                [f"{percentile(firsts, 0.5) * 1e3:.0f}", f"{percentile(firsts, 0.95) * 1e3:.0f}"]
                if firsts
                else ["-", "-"]
            )
            latency += (
                [f"{percentile(gaps, 0.5) * 1e3:.1f}", f"{percentile(gaps, 0.95) * 1e3:.1f}"]
                if gaps
                else ["-", "-"]
            )
            rows.append(
                [name, str(count), f"{rate(name, count):.1f}", f"{best.tokens_per_s:.1f}", *latency]
            )
    table = markdown_table(
        [
            "contender",
            "streams",
            "tok/s (median)",
            "best",
            "TTFT p50 ms",
            "TTFT p95 ms",
            "ITL p50 ms",
            "ITL p95 ms",
        ],
        rows,
    )
    notes = [
        f"- {name} at {count} streams failed: {message[:160]}"
        for name, by_count in failures.items()
        for count, message in by_count.items()
    ]
    single = "tandem single (HTTP)"
    raw = "mlx-lm batch_generate (ceiling)"
    for peer, target in ((SERVER_MKL, 1.1), (SERVER, 1.2), (raw, 0.95)):
        if single in results and peer in results:
            ratios = ", ".join(
                f"{count}: {rate(single, count) / rate(peer, count):.2f}x" for count in CONCURRENCY
            )
            notes.append(f"- tandem single / {peer}, by streams: {ratios} (target >= {target}x)")
    if single in results:
        notes.append(
            f"- tandem single at 8 streams / at 1 stream: {rate(single, 8) / rate(single, 1):.2f}x "
            "(target >= 2.5x)"
        )
    if raw in results:
        notes.append(
            f"- ceiling of this CPU, mlx-lm batch_generate at 8 / at 1: "
            f"{rate(raw, 8) / rate(raw, 1):.2f}x"
        )
    for pipeline in ("tandem pp=2 (in-process)", "tandem pp=3 (in-process)"):
        if pipeline in results:
            notes.append(
                f"- {pipeline} at 8 streams / at 1 stream: "
                f"{rate(pipeline, 8) / rate(pipeline, 1):.2f}x (target for pp=2 >= 1.5x)"
            )
    sampling = f"temperature {TEMPERATURE:g} without a seed" if TEMPERATURE else "greedy"
    setup = (
        f"Each burst: N streaming completions of {MAX_TOKENS} tokens with different prompts, "
        f"{sampling}, started together; medians of {rounds} interleaved rounds. tok/s = all "
        "completion tokens over the burst's wall time (prefill included); TTFT and ITL pooled "
        "over every stream of every round."
    )
    return "\n\n".join([setup, table.rstrip(), "\n".join(notes), f"Command: `{command}`"])


def main() -> None:
    global TEMPERATURE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--only", nargs="*", help="contender names to keep (substring match)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs alone")
    parser.add_argument("--temperature", type=float, default=TEMPERATURE)
    arguments = parser.parse_args()
    TEMPERATURE = arguments.temperature
    model_path = ensure_demo_model(MODEL_CACHE, MODEL)
    with contextlib.ExitStack() as cleanup:
        contenders = build_contenders(model_path, cleanup, arguments.only)
        results = measure(contenders, arguments.rounds)
    body = render(results, arguments.rounds, " ".join([COMMAND, *sys.argv[1:]]))
    if not arguments.only or any("stall" in part for part in arguments.only):
        body += "\n\n" + stall_note(model_path)
    sys.stdout.write(body + "\n")
    if not arguments.no_write:
        write_section(HEADING, body)


def stall_note(model_path: Path) -> str:
    """How long a 2,000-token newcomer stalls 4 running streams (chunked prefill)."""
    from engines.core.engine import DEFAULT_PREFILL_CHUNK
    from engines.single.engine import SingleEngine

    runner = EngineRunner(SingleEngine(model_path), queue_size=8)
    runner.start(300)
    try:
        longest, typical = measure_stall(runner)
    finally:
        runner.close()
    return (
        f"Stall: while a 2,000-token prompt is prefilled (chunks of {DEFAULT_PREFILL_CHUNK} "
        f"tokens interleaved with decode steps), the longest gap between two tokens of 4 "
        f"running streams was {longest * 1e3:.0f} ms (their median gap before it: "
        f"{typical * 1e3:.0f} ms)."
    )


def build_contenders(
    model_path: Path, cleanup: contextlib.ExitStack, only: list[str] | None
) -> dict[str, Callable[[int], Awaitable[Burst]]]:
    """Start every server and engine; `cleanup` stops them all, whatever happens later."""
    from tests.bench.pipeline_cluster import open_pipeline_runner
    from tests.bench.tp_cluster import open_tensor_parallel_runner

    wanted = (lambda name: any(part in name for part in only)) if only else (lambda name: True)
    scratch = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="tandem-batch-")))
    contenders: dict[str, Callable[[int], Awaitable[Burst]]] = {}
    client = cleanup.enter_context(httpx.Client(trust_env=False))
    if wanted("tandem single (HTTP)"):
        port = free_port(HOST)
        command = tandem_command(model_path, port, scratch) + [
            "--max-batch",
            "16",
            "--queue-size",
            "32",
        ]
        tandem = ServerProcess("tandem serve", command, port, scratch / "tandem.log")
        cleanup.callback(tandem.stop)
        tandem.start()
        tandem.wait_healthy(client)
        model_id = client.get(f"{tandem.base_url}/v1/models").json()["data"][0]["id"]
        contenders["tandem single (HTTP)"] = http_contender(tandem.base_url, model_id)
    for name in (SERVER, SERVER_MKL):
        if not wanted(name):
            continue
        environment = None
        if name == SERVER_MKL:
            from engines.core.blas import activate

            environment = dict(os.environ, LD_PRELOAD=activate().path)
        port = free_port(HOST)
        server = ServerProcess(
            name, mlx_server_command(model_path, port), port, scratch / f"{port}.log", environment
        )
        cleanup.callback(server.stop)
        server.start()
        server.wait_healthy(client)
        contenders[name] = http_contender(server.base_url, None)
    if wanted("tandem tp=2 (in-process)"):
        runner = cleanup.enter_context(open_tensor_parallel_runner(model_path, 2))
        contenders["tandem tp=2 (in-process)"] = runner_contender(runner)
    for stages in (2, 3):
        name = f"tandem pp={stages} (in-process)"
        if wanted(name):
            runner = cleanup.enter_context(open_pipeline_runner(model_path, stages))
            contenders[name] = runner_contender(runner)
    if wanted("mlx-lm batch_generate (ceiling)"):
        contenders["mlx-lm batch_generate (ceiling)"] = raw_batch_contender(model_path)
    return contenders


if __name__ == "__main__":
    main()
