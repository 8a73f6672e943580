"""Tensor parallel on real ring groups over 127.0.0.1: output, stopping, losing a rank."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from engines.base import GenerationRequest
from engines.runner import EngineRunner
from engines.single import SingleEngine
from engines.tensor_parallel import (
    TensorParallelEngine,
    WorkerSpec,
    jaccl_specs,
    loopback_ring_specs,
    ring_specs,
)
from engines.tensor_parallel.group import group_environment
from engines.tensor_parallel.lockstep import (
    GENERATE,
    Command,
    DivergenceError,
    Lockstep,
    check_sync,
    decode_header,
    encode_header,
    generate_in_lockstep,
)
from planner.errors import EngineError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
WORKER = [sys.executable, "-m", "engines.tensor_parallel.worker"]
PROMPTS = ("The quick brown fox", "Once upon a time, in a city by the sea,", "def main():")
LOAD_TIMEOUT_S = 60.0

pytestmark = pytest.mark.cluster


# -- helpers -------------------------------------------------------------------------------


def start_rank(spec: dict[str, Any]) -> subprocess.Popen[bytes]:
    """Start one rank worker the way an agent does: the spec as the first stdin line."""
    process = subprocess.Popen(
        WORKER,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=PROJECT_ROOT,
    )
    assert process.stdin is not None
    process.stdin.write((json.dumps(spec) + "\n").encode())
    process.stdin.flush()  # stdin stays open: EOF would tell the worker its agent is gone
    return process


def stop_processes(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()


@dataclass
class Cluster:
    engine: TensorParallelEngine
    ranks: list[subprocess.Popen[bytes]]
    lost: list[str]


def open_cluster(model_dir: Path, world_size: int = 2, **engine_options: Any) -> Cluster:
    specs = loopback_ring_specs(world_size, model_dir)
    ranks = [start_rank(spec) for spec in specs[1:]]
    lost: list[str] = []
    engine = TensorParallelEngine(
        model_dir, specs[0], on_lost=lost.append, load_timeout_s=LOAD_TIMEOUT_S, **engine_options
    )
    try:
        engine.load()
    except BaseException:
        engine.close()
        stop_processes(ranks)
        raise
    return Cluster(engine, ranks, lost)


def close_cluster(cluster: Cluster) -> None:
    cluster.engine.close()
    stop_processes(cluster.ranks)


@dataclass
class Outcome:
    tokens: list[int]
    text: str
    finish: str | None
    error: str | None
    events: int


async def collect(
    runner: EngineRunner, request: GenerationRequest, cancel_after: int = 0
) -> Outcome:
    submission = runner.submit(request)
    tokens: list[int] = []
    text, events = "", 0
    async for event in submission.events():
        events += 1
        if event.token is not None:
            tokens.append(event.token)
            if len(tokens) == cancel_after:
                submission.cancel()
        text += event.text
        if event.finish_reason is not None:
            return Outcome(tokens, text, event.finish_reason, event.error, events)
    raise AssertionError("the event stream ended without a final event")


def run_all(runner: EngineRunner, requests: list[GenerationRequest]) -> list[Outcome]:
    """Queue every request at once on `runner` and wait for all of them."""

    async def gather() -> list[Outcome]:
        return list(
            await asyncio.wait_for(asyncio.gather(*(collect(runner, r) for r in requests)), 60)
        )

    return asyncio.run(gather())


def run_one(runner: EngineRunner, request: GenerationRequest, cancel_after: int = 0) -> Outcome:
    return asyncio.run(asyncio.wait_for(collect(runner, request, cancel_after), 60))


def request(
    runner: EngineRunner, prompt: str, max_tokens: int, **options: Any
) -> GenerationRequest:
    tokens = tuple(runner.engine.tokenizer.encode(prompt))
    return GenerationRequest(f"r-{prompt[:8]}-{max_tokens}", tokens, max_tokens, **options)


def drain_until_error(
    engine: TensorParallelEngine, prompt: tuple[int, ...], tokens: Iterator[int] | None = None
) -> EngineError:
    """Consume `tokens`, then fresh requests (one may end by EOS first), until EngineError."""
    fresh = (engine.generate_tokens(GenerationRequest(f"x{n}", prompt, 10_000)) for n in range(3))
    try:
        for generation in itertools.chain([tokens] if tokens else [], fresh):
            for _ in generation:
                pass
    except EngineError as error:
        return error
    raise AssertionError("the lost rank never turned into an EngineError")


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_runner(demo_model_dir: Path) -> Iterator[EngineRunner]:
    runner = EngineRunner(SingleEngine(demo_model_dir))
    runner.start(LOAD_TIMEOUT_S)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def cluster(demo_model_dir: Path) -> Iterator[Cluster]:
    cluster = open_cluster(demo_model_dir)
    yield cluster
    close_cluster(cluster)


@pytest.fixture(scope="module")
def tp_runner(cluster: Cluster) -> Iterator[EngineRunner]:
    runner = EngineRunner(cluster.engine)
    runner.start(LOAD_TIMEOUT_S)  # load() already ran; the runner only starts its thread
    yield runner
    runner.close()


@pytest.fixture(autouse=True)
def _engine_stays_healthy(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "tp_runner" in request.fixturenames:
        cluster = request.getfixturevalue("cluster")
        assert cluster.engine.healthy(), cluster.lost


# -- the shared two-rank cluster -----------------------------------------------------------


def test_greedy_output_equals_single_token_for_token(tp_runner, single_runner):
    for prompt in PROMPTS:
        expected = run_one(single_runner, request(single_runner, prompt, 64))
        got = run_one(tp_runner, request(tp_runner, prompt, 64))
        assert got.tokens == expected.tokens, prompt
        assert (got.text, got.finish) == (expected.text, expected.finish)
        assert len(got.tokens) >= 16  # the comparison means something
        assert got.events >= len(got.tokens) + 1  # streamed one event per token, then the end


def test_seeded_sampling_equals_single(tp_runner, single_runner):
    for seed in (7, 1234):
        options = {"temperature": 1.0, "top_p": 0.9, "seed": seed}
        expected = run_one(single_runner, request(single_runner, PROMPTS[0], 32, **options))
        got = run_one(tp_runner, request(tp_runner, PROMPTS[0], 32, **options))
        assert got.tokens == expected.tokens
    greedy = run_one(single_runner, request(single_runner, PROMPTS[0], 32))
    assert got.tokens != greedy.tokens  # sampling really sampled


def test_early_stops_leave_every_rank_ready_for_the_next_request(tp_runner, single_runner):
    full = run_one(single_runner, request(single_runner, PROMPTS[1], 64))
    assert len(full.tokens) >= 40

    short = run_one(tp_runner, request(tp_runner, PROMPTS[1], 3))
    assert (short.tokens, short.finish) == (full.tokens[:3], "length")

    # A stop string that first appears around the 20th token: the runner stops mid-sync-window.
    position = len(tp_runner.engine.tokenizer.decode(full.tokens[:20]))
    stop = full.text[position : position + 3]
    expected = run_one(single_runner, request(single_runner, PROMPTS[1], 64, stop=(stop,)))
    stopped = run_one(tp_runner, request(tp_runner, PROMPTS[1], 64, stop=(stop,)))
    assert stopped.finish == expected.finish == "stop"
    assert stopped.text == expected.text == full.text[: full.text.find(stop)]

    cancelled = run_one(tp_runner, request(tp_runner, PROMPTS[1], 5_000), cancel_after=5)
    assert cancelled.finish == "cancelled"
    assert cancelled.tokens[:5] == full.tokens[:5]

    after = run_one(tp_runner, request(tp_runner, PROMPTS[1], 64))
    assert after.tokens == full.tokens


def test_queued_requests_are_all_answered_correctly(tp_runner, single_runner):
    specs = [
        (PROMPTS[0], 24, {}),
        (PROMPTS[1], 16, {"temperature": 1.0, "seed": 5}),
        (PROMPTS[2], 24, {}),
        (PROMPTS[0], 8, {"temperature": 0.7, "top_p": 0.5, "seed": 9}),
    ]
    expected = [run_one(single_runner, request(single_runner, p, n, **o)) for p, n, o in specs]
    got = run_all(tp_runner, [request(tp_runner, p, n, **o) for p, n, o in specs])
    assert [g.tokens for g in got] == [e.tokens for e in expected]
    assert all(g.finish in ("length", "stop") for g in got)


def test_a_refused_request_keeps_the_group(tp_runner, single_runner):
    refused = run_one(tp_runner, GenerationRequest("bad", (10**6,), 8))
    assert refused.finish == "error" and "token ids" in refused.error
    expected = run_one(single_runner, request(single_runner, PROMPTS[2], 8))
    assert run_one(tp_runner, request(tp_runner, PROMPTS[2], 8)).tokens == expected.tokens


def test_info_describes_every_rank(cluster):
    info = cluster.engine.info()
    assert (info.strategy, info.world_size, info.detail["backend"]) == ("tp", 2, "ring")
    assert [rank["rank"] for rank in info.detail["ranks"]] == [0, 1]
    assert all(rank["peak_memory_bytes"] > 0 for rank in info.detail["ranks"])
    assert all(rank["address"].startswith("127.0.0.1:") for rank in info.detail["ranks"])


# -- losing a rank (each test owns its cluster) --------------------------------------------


def test_killing_rank_1_mid_generation_raises_quickly(demo_model_dir):
    cluster = open_cluster(demo_model_dir)
    try:
        prompt = tuple(cluster.engine.tokenizer.encode(PROMPTS[0]))
        tokens = cluster.engine.generate_tokens(GenerationRequest("a", prompt, 10_000))
        assert len([next(tokens) for _ in range(4)]) == 4
        cluster.ranks[0].kill()
        started = time.monotonic()
        error = drain_until_error(cluster.engine, prompt, tokens)
        assert time.monotonic() - started < 10
        assert "tensor-parallel rank 0 lost" in str(error)
        assert not cluster.engine.healthy()
        assert len(cluster.lost) == 1 and "connection" in cluster.lost[0]
    finally:
        close_cluster(cluster)


def test_abort_unblocks_a_generation_stuck_on_a_frozen_rank(demo_model_dir):
    cluster = open_cluster(demo_model_dir, token_timeout_s=30, first_token_timeout_s=30)
    frozen = cluster.ranks[0]
    try:
        prompt = tuple(cluster.engine.tokenizer.encode(PROMPTS[0]))
        tokens = cluster.engine.generate_tokens(GenerationRequest("a", prompt, 10_000))
        next(tokens)
        os.kill(frozen.pid, signal.SIGSTOP)  # its sockets stay open: all_sum blocks, no error
        threading.Timer(1.0, cluster.engine.abort, ["agent lost"]).start()
        started = time.monotonic()
        error = drain_until_error(cluster.engine, prompt, tokens)
        assert time.monotonic() - started < 5  # long before the 30 s token timeout
        assert "aborted: agent lost" in str(error)
        assert not cluster.engine.healthy()
        assert cluster.lost == []  # the supervisor called abort: no callback back to it
    finally:
        os.kill(frozen.pid, signal.SIGKILL)
        close_cluster(cluster)


def test_token_timeout_catches_a_frozen_rank(demo_model_dir):
    cluster = open_cluster(demo_model_dir, token_timeout_s=1.5, first_token_timeout_s=3)
    frozen = cluster.ranks[0]
    try:
        prompt = tuple(cluster.engine.tokenizer.encode(PROMPTS[0]))
        tokens = cluster.engine.generate_tokens(GenerationRequest("a", prompt, 10_000))
        next(tokens)
        os.kill(frozen.pid, signal.SIGSTOP)
        started = time.monotonic()
        error = drain_until_error(cluster.engine, prompt, tokens)
        assert time.monotonic() - started < 6
        assert "no answer from rank 0 within" in str(error)
        assert not cluster.engine.healthy() and cluster.lost
    finally:
        os.kill(frozen.pid, signal.SIGKILL)
        close_cluster(cluster)


def test_an_idle_group_notices_a_rank_whose_agent_went_away(demo_model_dir):
    cluster = open_cluster(demo_model_dir)
    try:
        stdin = cluster.ranks[0].stdin
        assert stdin is not None
        stdin.close()  # what an agent that exits looks like to its worker
        assert cluster.ranks[0].wait(10) == 0
        deadline = time.monotonic() + 5
        while not cluster.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(cluster.lost) == 1  # noticed by the idle heartbeat, no request needed
        assert "connection to a peer was lost" in cluster.lost[0]
        assert not cluster.engine.healthy()
        prompt = tuple(cluster.engine.tokenizer.encode(PROMPTS[0]))
        with pytest.raises(EngineError, match="rank 0 lost"):
            list(cluster.engine.generate_tokens(GenerationRequest("late", prompt, 4)))
    finally:
        close_cluster(cluster)


# -- other group shapes and refusals -------------------------------------------------------


def test_three_ranks_equal_single(demo_model_factory):
    model_dir = demo_model_factory(heads=6, kv_heads=3, layers=2)
    single = SingleEngine(model_dir)
    single.load()
    cluster = open_cluster(model_dir, world_size=3)
    try:
        for prompt in PROMPTS[:2]:
            tokens = tuple(single.tokenizer.encode(prompt))
            greedy = GenerationRequest("g", tokens, 24)
            assert list(cluster.engine.generate_tokens(greedy)) == list(
                single.generate_tokens(greedy)
            )
        assert cluster.engine.info().world_size == 3
    finally:
        close_cluster(cluster)
        single.close()


def test_a_model_with_odd_heads_fails_to_load_with_the_reason(odd_heads_model_dir):
    specs = loopback_ring_specs(2, odd_heads_model_dir)
    rank1 = start_rank(specs[1])
    engine = TensorParallelEngine(odd_heads_model_dir, specs[0], load_timeout_s=LOAD_TIMEOUT_S)
    try:
        with pytest.raises(EngineError, match="divisible by 2.*3 attention heads"):
            engine.load()
        failed = json.loads(rank1.stdout.readline())
        assert failed["event"] == "failed" and "3 KV heads" in failed["reason"]
        assert rank1.wait(10) != 0
        assert not engine.healthy()
    finally:
        engine.close()
        stop_processes([rank1])


def test_an_invalid_spec_is_reported_on_stdout(tmp_path):
    process = subprocess.run(
        WORKER,
        input=json.dumps({"rank": 3, "world_size": 2, "backend": "ring"}) + "\n",
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=30,
    )
    event = json.loads(process.stdout)
    assert process.returncode == 2
    assert event["event"] == "failed" and "rank 3 is outside a world of size 2" in event["reason"]


# -- the lockstep protocol and specs, in-process -------------------------------------------


def test_header_round_trips_exact_floats_and_large_seeds():
    command = Command(GENERATE, (5, 6, 7), 99, 2**63 + 11, 0.7, 0.95, 8, wait_after_s=0.032)
    decoded = decode_header(encode_header(command))
    assert decoded.wait_after_s == 0.032
    assert (decoded.max_tokens, decoded.seed, decoded.temperature, decoded.top_p) == (
        99,
        2**63 + 11,
        0.7,
        0.95,
    )
    assert len(decoded.prompt) == 3 and decoded.sync_every == 8


def test_sync_detects_diverging_ranks():
    assert check_sync([1, 42, 42, 42], 3) is True
    assert check_sync([0, 42, 42, 42], 3) is False
    with pytest.raises(DivergenceError, match=r"ranks \[2\]"):
        check_sync([0, 42, 42, 41], 3)


def test_a_stop_takes_effect_at_the_next_sync_point(demo_model_dir):
    single = SingleEngine(demo_model_dir)
    single.load()
    prompt = tuple(single.tokenizer.encode(PROMPTS[1]))
    lockstep = Lockstep(mx.distributed.init())  # a group of one: the same code path
    command = lockstep.broadcast_command(Command(GENERATE, prompt, 64, 0, 0.0, 1.0, 8))
    assert command.prompt == prompt
    emitted: list[int] = []
    reason = generate_in_lockstep(
        single.model, command, lockstep, set(), emitted.append, lambda: len(emitted) >= 3
    )
    expected = list(single.generate_tokens(GenerationRequest("s", prompt, 8)))
    assert (reason, emitted) == ("stopped", expected)
    single.close()


def test_specs_for_ring_and_jaccl(tmp_path):
    ring = ring_specs(["10.0.0.1", "10.0.0.2"], [5000, 5001], "/models/m", sync_every=4)
    assert [spec["rank"] for spec in ring] == [0, 1]
    assert ring[1]["hosts"] == [["10.0.0.1:5000"], ["10.0.0.2:5001"]]
    assert ring[0]["sync_every"] == 4 and ring[0]["backend"] == "ring"
    environment = group_environment(WorkerSpec.from_dict(ring[1]), tmp_path)
    assert environment["MLX_RANK"] == "1"
    assert json.loads(Path(environment["MLX_HOSTFILE"]).read_text()) == ring[1]["hosts"]

    devices = [[None, "rdma_en3"], ["rdma_en3", None]]
    jaccl = jaccl_specs(devices, "10.0.0.1:5500", "/models/m")
    environment = group_environment(WorkerSpec.from_dict(jaccl[1]), tmp_path)
    assert environment["MLX_JACCL_COORDINATOR"] == "10.0.0.1:5500"
    assert json.loads(Path(environment["MLX_IBV_DEVICES"]).read_text()) == devices

    with pytest.raises(ValueError, match="2 addresses but 1 ports"):
        ring_specs(["a", "b"], [1], "/m")
    with pytest.raises(ValueError, match="2x2 ibv_devices"):
        jaccl_specs([[None, "x"], ["x"]], "h:1", "/m")
    with pytest.raises(ValueError, match="unknown worker spec keys"):
        WorkerSpec.from_dict({**ring[0], "hosst": []})
