"""The engine core in a process of its own: the same tokens as on a thread, every ending
across the boundary, and a core that dies or freezes ends its streams at once."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from engines.core.core_process import CoreProcess
from engines.core.engine_spec import EngineSpec
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.single.engine import SingleEngine
from errors import QueueFullError
from tests.helpers.engine import run_all

pytestmark = pytest.mark.cluster  # a real child process per runner

LOAD_TIMEOUT_S = 60.0


def single_spec(model: Path) -> EngineSpec:
    return EngineSpec("engines.cluster.engine_factories:single", {"model_path": str(model)})


def core_runner(model: Path, lost_after_s: float = 5.0) -> EngineRunner:
    runner = EngineRunner(CoreProcess(single_spec(model), 4, lost_after_s), 8, 4)
    try:
        runner.start(LOAD_TIMEOUT_S)
    except BaseException:
        runner.close()
        raise
    return runner


@pytest.fixture(scope="module")
def apart(demo_model_dir: Path) -> Iterator[EngineRunner]:
    runner = core_runner(demo_model_dir)
    try:
        yield runner
    finally:
        runner.close()


def requests(tokenizer, **options) -> list[GenerationRequest]:
    prompts = ["The first stream", "A second, longer stream of words", "Third"]
    return [
        GenerationRequest(f"r{i}", tuple(tokenizer.encode(p)), 12, **options)
        for i, p in enumerate(prompts)
    ]


def wait_idle(runner: EngineRunner, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not runner.idle and time.monotonic() < deadline:
        time.sleep(0.02)
    assert runner.idle, f"{runner.active} active, {runner.queued} queued"


def test_the_core_apart_gives_what_the_core_on_a_thread_gives(
    apart: EngineRunner, demo_model_dir: Path
) -> None:
    here = EngineRunner(SingleEngine(demo_model_dir), 8, 4)
    here.start(LOAD_TIMEOUT_S)
    try:
        for options in ({}, {"temperature": 0.8, "seed": 7, "logprobs": 2}):
            batch = requests(apart.engine.tokenizer, **options)
            remote, local = run_all(apart, batch), run_all(here, batch)
            for far, near in zip(remote, local, strict=True):
                assert far.tokens == near.tokens and far.text == near.text
                assert (far.finish, far.completion_tokens) == (near.finish, near.completion_tokens)
                # equal tokens; logprobs to float noise (a batch can form a step apart)
                assert far.logprobs == pytest.approx(near.logprobs, abs=1e-3)
    finally:
        here.close()
    wait_idle(apart)
    assert apart.engine.info().strategy == "single" and apart.engine.healthy()
    memory = apart.memory_accounting()
    assert memory["engine_core"]["weights"] > 0 and memory["api"]["weights"] == 0


def test_stop_strings_cancels_and_deadlines_end_streams_and_free_the_batch(
    apart: EngineRunner,
) -> None:
    tokenizer = apart.engine.tokenizer
    prompt = tuple(tokenizer.encode("Stop here"))
    whole = run_all(apart, [GenerationRequest("whole", prompt, 24)])[0]
    stop = whole.text[len(whole.text) // 2 :][:3]
    cut, cancelled, late = run_all(
        apart,
        [
            GenerationRequest("stop", prompt, 24, stop=(stop,)),
            GenerationRequest("cancel", prompt, 2000),
            GenerationRequest("late", prompt, 2000, timeout_s=0.3),
        ],
        cancel_after={1: 3},
    )
    assert cut.finish == "stop" and whole.text.startswith(cut.text) and stop not in cut.text
    assert cancelled.finish == "cancelled" and len(cancelled.tokens) >= 3
    assert late.finish == "error" and "timed out" in late.error
    wait_idle(apart)  # the core let every one of them go


def test_a_request_is_recorded_with_its_outcome_once_the_core_lets_it_go(
    apart: EngineRunner,
) -> None:
    recorded: list[str] = []

    async def one() -> str:
        request = GenerationRequest("rec", tuple(apart.engine.tokenizer.encode("hi")), 5)
        submission = apart.submit(request, on_finish=lambda s, e: recorded.append(e.finish_reason))
        async for event in submission.events():
            if event.finish_reason is not None:
                return event.finish_reason
        return ""

    assert asyncio.run(one()) == "length"
    wait_idle(apart)
    assert recorded == ["length"]


def stream_then(runner: EngineRunner, act, max_tokens: int = 4000) -> tuple[str, str, float]:
    """Start a long stream; after its first token run `act`; (finish, error, seconds from
    `act` to the final event)."""

    async def go() -> tuple[str, str, float]:
        request = GenerationRequest("long", tuple(runner.engine.tokenizer.encode("go")), max_tokens)
        submission = runner.submit(request)
        acted_at = None
        async for event in submission.events():
            if acted_at is None and event.token is not None:
                act()
                acted_at = time.monotonic()
            if event.finish_reason is not None:
                return event.finish_reason, event.error or "", time.monotonic() - (acted_at or 0)
        raise AssertionError("no final event")

    return asyncio.run(asyncio.wait_for(go(), 60))


def test_a_killed_core_ends_its_streams_with_an_error_at_once(demo_model_dir: Path) -> None:
    runner = core_runner(demo_model_dir)
    try:
        pid = runner.core.pid
        finish, error, after_s = stream_then(runner, lambda: os.kill(pid, signal.SIGKILL))
        assert finish == "error" and "engine core exited" in error
        assert after_s < 1.0
        assert not runner.engine.healthy()
    finally:
        runner.close()


def test_a_frozen_core_is_killed_within_lost_after(demo_model_dir: Path) -> None:
    lost_after_s = 3.0  # a first step starved of CPU by a busy suite must not look frozen
    runner = core_runner(demo_model_dir, lost_after_s)
    pid = runner.core.pid
    try:
        finish, error, after_s = stream_then(runner, lambda: os.kill(pid, signal.SIGSTOP))
        assert finish == "error" and "stopped answering" in error
        assert after_s < lost_after_s + 1.0
        assert not runner.engine.healthy()
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    finally:
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)
        runner.close()


def test_closing_the_runner_stops_the_core_process(demo_model_dir: Path) -> None:
    runner = core_runner(demo_model_dir)
    pid = runner.core.pid
    runner.close()
    assert runner.core._child.poll() is not None, f"the core (pid {pid}) still runs"


def test_the_queue_bound_holds_across_the_boundary(apart: EngineRunner) -> None:
    """--max-batch 4 and --queue-size 8: twelve are taken, the thirteenth is a 429."""
    prompt = tuple(apart.engine.tokenizer.encode("queue"))

    async def flood() -> int:
        submissions = [apart.submit(GenerationRequest(f"q{i}", prompt, 64)) for i in range(12)]
        with pytest.raises(QueueFullError):
            apart.submit(GenerationRequest("q12", prompt, 64))
        for submission in submissions:
            submission.cancel()
        finished = 0
        for submission in submissions:
            async for event in submission.events():
                finished += event.finish_reason is not None
        return finished

    assert asyncio.run(asyncio.wait_for(flood(), 60)) == 12
    wait_idle(apart)
