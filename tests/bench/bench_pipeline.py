"""Pipeline benchmark: single vs 2- and 3-stage pipelines, and what sealing costs per token.

Run from the project root: `python -m tests.bench.bench_pipeline` (about two minutes). It prints
a markdown section and writes it to docs/benchmarks.md under "## Pipeline".

The plaintext channel below exists only here, to price sealing; no user-facing switch does it.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from discovery.cluster_key import generate_key
from discovery.framing import connect, recv_frame, send_frame
from discovery.sealing import derive_session_keys
from engines.base import GenerationRequest
from engines.demo_model import DemoSpec, write_demo_model
from engines.pipeline import wire
from engines.pipeline.engine import EncryptedPipelineEngine
from engines.pipeline.stage_worker import StageProcess, run
from engines.single import SingleEngine
from planner import allocate_layers
from tests.bench.common import (
    BENCHMARKS_DOC,
    Sample,
    markdown_table,
    median_of,
    run_interleaved,
    sample_from_stamps,
    write_section,
)

HOST = "127.0.0.1"
MODEL = DemoSpec(layers=8, hidden=512, heads=8, kv_heads=4, vocab=1024)
PROMPT = "The pipeline benchmark measures how fast sealed activations travel between stages."
DECODE_TOKENS = 96
ROUNDS = 7
PAIRS = 8
STAGE_COUNTS = (2, 3)
MICRO_ITERATIONS = 5000
PLAIN_FLAG = "--plain-stage-worker"
BENCH_MODULE = "tests.bench.bench_pipeline"
HEADING = "## Pipeline"
COMMAND = "python -m tests.bench.bench_pipeline"


class PlaintextChannel:
    """SecureChannel's interface without a handshake or AEAD: the benchmark's control group."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.closed = False

    @classmethod
    def client(
        cls, sock: socket.socket, key: bytes, purpose: bytes, timeout_s: float = 10.0
    ) -> PlaintextChannel:
        sock.settimeout(timeout_s)
        return cls(sock)

    server = client

    def send(self, payload: bytes, associated: bytes = b"") -> None:
        send_frame(self._sock, payload)

    def recv(self, timeout_s: float, associated: bytes = b"") -> bytes:
        return recv_frame(self._sock, timeout_s)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()


def time_generation(engine: Any, prompt: tuple[int, ...]) -> Sample:
    """Time to first token and the decode rate after it, straight from generate_tokens."""
    stamps, started = stamp_tokens(engine, prompt)
    return sample_from_stamps(started, stamps[0], stamps[-1], len(stamps))


def median_gap(engine: Any, prompt: tuple[int, ...]) -> float:
    """The median time between consecutive tokens: robust to a busy neighbour's bursts."""
    stamps, _ = stamp_tokens(engine, prompt)
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False))


def stamp_tokens(engine: Any, prompt: tuple[int, ...]) -> tuple[list[float], float]:
    request = GenerationRequest("bench", prompt, max_tokens=DECODE_TOKENS, seed=0)
    started = time.perf_counter()
    stamps: list[float] = []
    tokens = engine.generate_tokens(request)
    for _ in tokens:
        stamps.append(time.perf_counter())
        if len(stamps) == DECODE_TOKENS:
            break
    tokens.close()
    return stamps, started


def start_pipeline(model: Path, stages: int, key: bytes, plain: bool) -> tuple[Any, list]:
    """Stage workers for stages 1.. (last first) and the loaded coordinator engine."""
    ranges = allocate_layers(MODEL.layers, [1] * stages)
    listener = socket.create_server((HOST, 0))
    next_port, workers = listener.getsockname()[1], []
    for index in reversed(range(1, stages)):
        spec = {
            "model_path": str(model),
            "layers": [ranges[index].start, ranges[index].stop],
            "is_last": index == stages - 1,
            "next_host": HOST,
            "next_port": next_port,
            "cluster_key": key.hex(),
        }
        if plain:  # this file again, serving with PlaintextChannel
            worker = StageProcess.start(spec, module=BENCH_MODULE, arguments=(PLAIN_FLAG,))
        else:  # the real stage worker
            worker = StageProcess.start(spec)
        workers.insert(0, worker)
        next_port = worker.port
    addresses = [{"host": HOST, "port": worker.port} for worker in workers]
    options = {"channel_class": PlaintextChannel} if plain else {}
    engine = EncryptedPipelineEngine(
        model, ranges[0], addresses, HOST, key, return_listener=listener, **options
    )
    engine.load()
    return engine, workers


def measure_engines(model: Path) -> tuple[dict[str, list[Sample]], dict[int, list[float]]]:
    """Every configuration loaded at once and run interleaved, so drift hits them all alike;
    then sealed/plaintext pairs back to back: per stage count, the per-token differences."""
    key = generate_key()
    single = SingleEngine(model)
    single.load()
    prompt = tuple(single.tokenizer.encode(PROMPT))
    engines: dict[str, Any] = {"single": single}
    workers: list[StageProcess] = []
    try:
        for stages in STAGE_COUNTS:
            for plain in (False, True):
                name = f"pp{stages}-{'plain' if plain else 'sealed'}"
                engines[name], started = start_pipeline(model, stages, key, plain)
                workers += started
        contenders = {
            name: (lambda engine=engine: time_generation(engine, prompt))
            for name, engine in engines.items()
        }
        samples = run_interleaved(contenders, ROUNDS)
        differences: dict[int, list[float]] = {stages: [] for stages in STAGE_COUNTS}
        for pair in range(PAIRS):
            for stages in STAGE_COUNTS:
                sealed, plain = engines[f"pp{stages}-sealed"], engines[f"pp{stages}-plain"]
                if pair % 2:  # alternate which one goes first
                    plain_gap, sealed_gap = median_gap(plain, prompt), median_gap(sealed, prompt)
                else:
                    sealed_gap, plain_gap = median_gap(sealed, prompt), median_gap(plain, prompt)
                differences[stages].append(sealed_gap - plain_gap)
        return samples, differences
    finally:
        for engine in engines.values():
            engine.close()
        for worker in workers:
            worker.stop()


def measure_aead(activation_bytes: int) -> float:
    """Median seconds for one seal + open of an activation-sized pipeline frame."""
    keys = derive_session_keys(bytes(32), generate_key(), bytes(32))
    sealer, opener = keys.sealer("client"), keys.opener("server")
    payload = bytes(activation_bytes)
    associated = wire.associated_data(1, range(0, 4), 1)
    samples = []
    for _ in range(MICRO_ITERATIONS):
        started = time.perf_counter()
        opener.open(sealer.seal(payload, associated), associated)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def measure_round_trip(activation_bytes: int) -> float:
    """Median loopback TCP round trip of an activation-sized frame, echoed by a thread."""
    listener = socket.create_server((HOST, 0))
    trips = MICRO_ITERATIONS // 5

    def echo() -> None:
        connection, _ = listener.accept()
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with connection:
            for _ in range(trips):
                send_frame(connection, recv_frame(connection, 5.0))

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    client = connect(HOST, listener.getsockname()[1], 5.0)
    payload, samples = bytes(activation_bytes), []
    with client, listener:
        for _ in range(trips):
            started = time.perf_counter()
            send_frame(client, payload)
            recv_frame(client, 5.0)
            samples.append(time.perf_counter() - started)
    thread.join(5)
    return statistics.median(samples)


def decode_rate(samples: list[Sample]) -> float:
    return median_of(samples, lambda sample: sample.decode_tokens_per_s)


def render(
    timings: dict[str, list[Sample]],
    differences: dict[int, list[float]],
    aead_s: float,
    round_trip_s: float,
) -> str:
    activation = 4 * MODEL.hidden
    single_rate = decode_rate(timings["single"])
    speed_rows = []
    for name, samples in timings.items():
        first = median_of(samples, lambda sample: sample.first_token_s)
        rate = decode_rate(samples)
        speed_rows.append(
            [
                name,
                f"{first * 1e3:.1f}",
                f"{rate:.1f}",
                f"{1e3 / rate:.2f}",
                f"{rate / single_rate:.2f}",
            ]
        )
    sealing_rows = []
    for stages in STAGE_COUNTS:
        per_token = 1 / decode_rate(timings[f"pp{stages}-sealed"])
        difference = statistics.median(differences[stages])
        low, high = min(differences[stages]), max(differences[stages])
        estimate = stages * aead_s  # stages - 1 activation hops + the returning token
        sealing_rows.append(
            [
                str(stages),
                f"{per_token * 1e3:.2f}",
                f"{difference * 1e6:+.0f} µs ({difference / per_token:+.1%})",
                f"{low * 1e6:+.0f} … {high * 1e6:+.0f} µs",
                f"{estimate * 1e6:.1f} µs ({estimate / per_token:.2%})",
            ]
        )
    setup = (
        f"Demo model: llama, {MODEL.layers} layers, hidden {MODEL.hidden}, float32, layers split "
        f"evenly; {len(PROMPT.split())}-word prompt, greedy, {DECODE_TOKENS} tokens; one warm-up "
        f"each, then medians of {ROUNDS} interleaved rounds, timed around generate_tokens (no "
        "HTTP). The plaintext pipelines swap SecureChannel for an unsealed channel inside this "
        "benchmark only; the sealing table compares each sealed pipeline with its plaintext "
        "twin run back to back (median time between tokens)."
    )
    speed = markdown_table(
        [
            "configuration",
            "time to first token (ms)",
            "decode (tokens/s)",
            "ms / token",
            "vs single",
        ],
        speed_rows,
    )
    sealing = markdown_table(
        [
            "stages",
            "sealed ms / token",
            f"sealed - plaintext, median of {PAIRS} pairs",
            "range over the pairs",
            "AEAD work per token (hops x seal+open)",
        ],
        sealing_rows,
    )
    notes = "\n".join(
        [
            f"- AES-256-GCM seal + open of one {activation}-byte activation frame: "
            f"{aead_s * 1e6:.1f} µs (median of {MICRO_ITERATIONS}).",
            f"- Loopback TCP round trip of a {activation}-byte frame (Python, TCP_NODELAY): "
            f"{round_trip_s * 1e6:.0f} µs (median of {MICRO_ITERATIONS // 5}).",
            "- Target: sealing costs at most 5% of decode time. The AEAD column is the work "
            "sealing adds to each token; the measured difference is that plus scheduling noise "
            "on a shared 2-core machine (see its range).",
        ]
    )
    return "\n\n".join([setup, speed.rstrip(), sealing.rstrip(), notes, f"Command: `{COMMAND}`"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(PLAIN_FLAG, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=BENCHMARKS_DOC)
    arguments = parser.parse_args()
    if arguments.plain_stage_worker:
        sys.exit(run(channel_class=PlaintextChannel))
    with tempfile.TemporaryDirectory() as directory:
        model = write_demo_model(Path(directory) / "bench-model", MODEL)
        timings, differences = measure_engines(model)
    activation = 4 * MODEL.hidden
    aead_s, round_trip_s = measure_aead(activation), measure_round_trip(activation)
    section = render(timings, differences, aead_s, round_trip_s)
    sys.stdout.write(f"{HEADING}\n\n{section}\n")
    write_section(HEADING, section, arguments.output)


if __name__ == "__main__":
    main()
