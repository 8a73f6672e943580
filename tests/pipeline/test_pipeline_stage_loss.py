"""Losing a stage (killed, frozen, or the operator's abort): the batch fails fast, every stream
ends with an error naming the stage; a speculating stream too, its verifying pass in flight."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.pipeline.engine import EncryptedPipelineEngine
from engines.pipeline.stage_worker import StageProcess
from errors import EngineError
from planner import allocate_layers
from tests.helpers.pipeline import (
    PROMPTS,
    make_engine,
    run,
    run_all,
    start_workers,
    stop_workers,
)
from tests.helpers.scripted_drafter import ScriptedDrafter
from tests.helpers.signals import wake

pytestmark = pytest.mark.cluster

# -- losing a stage ------------------------------------------------------------------------------


def open_fragile(model: Path, key: bytes, log_dir: Path, **options: Any) -> Iterator[Any]:
    """A private 3-stage pipeline a test may kill or freeze; always cleaned up."""
    ranges = allocate_layers(5, [1, 1, 1])
    listener, workers = start_workers(model, ranges, key, log_dir)
    engine = make_engine(model, ranges, key, listener, workers, token_timeout_s=2.0, **options)
    try:
        engine.load()
        yield engine, workers
    finally:
        engine.close()
        stop_workers(workers)


@pytest.fixture
def fragile(five_layer_model: Path, cluster_key: bytes, tmp_path: Path) -> Iterator[Any]:
    yield from open_fragile(five_layer_model, cluster_key, tmp_path)


def long_requests(engine: EncryptedPipelineEngine, count: int = 8) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"doomed-{index}",
            tuple(engine.tokenizer.encode(PROMPTS[index % len(PROMPTS)])),
            max_tokens=100_000,
        )
        for index in range(count)
    ]


def decode_a_while(engine: EncryptedPipelineEngine, tokens: int = 40) -> None:
    """Insert a batch of 8 and step until `tokens` tokens came back (all 8 decoding)."""
    for uid, request in enumerate(long_requests(engine)):
        engine.insert(uid, request)
    seen: set[int] = set()
    produced = 0
    while produced < tokens or len(seen) < 8:
        outputs = engine.step()
        seen.update(output.uid for output in outputs)
        produced += len(outputs)


@pytest.mark.parametrize("victim", [0, 1])
def test_killed_stage_fails_the_batch_fast(fragile: Any, victim: int) -> None:
    engine, workers = fragile
    decode_a_while(engine)
    workers[victim].popen.kill()
    workers[victim].popen.wait(5)
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"pipeline stage lost .*\(8 sequences\)") as caught:
        while True:
            engine.step()
            assert time.monotonic() - started < 10
    assert time.monotonic() - started < 10
    assert not engine.healthy()
    # every stage the frames pass is named, with its layers and address
    for index, stage in enumerate(engine.stages, 1):
        assert stage.describe(index) in str(caught.value)
    assert "layers [" in str(caught.value)
    assert "failure" in engine.info().detail
    engine.remove(range(8))  # as the runner does: the batch is gone
    engine.insert(100, long_requests(engine, 1)[0])
    started = time.monotonic()
    with pytest.raises(EngineError):  # the next step tries to reconnect and cannot
        engine.step()
    assert time.monotonic() - started < 12


def test_frozen_stage_times_out(fragile: Any) -> None:
    engine, workers = fragile
    decode_a_while(engine)
    os.kill(workers[1].pid, signal.SIGSTOP)  # alive but silent: only a timeout catches it
    try:
        started = time.monotonic()
        with pytest.raises(EngineError, match="pipeline stage lost"):
            while True:
                engine.step()
        assert time.monotonic() - started < engine.token_timeout_s + 3
        assert not engine.healthy()
    finally:
        wake(workers[1].pid)


def test_abort_wakes_a_blocked_step(fragile: Any) -> None:
    engine, workers = fragile
    engine.token_timeout_s = 60.0
    decode_a_while(engine, tokens=8)
    os.kill(workers[0].pid, signal.SIGSTOP)
    timer = threading.Timer(0.5, engine.abort, args=("operator requested a re-plan",))
    try:
        started = time.monotonic()
        timer.start()
        with pytest.raises(EngineError, match="re-plan"):
            while True:
                engine.step()
        assert time.monotonic() - started < 5
    finally:
        timer.cancel()
        wake(workers[0].pid)


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_lost_stage_ends_every_stream_of_a_batch_with_an_error(fragile: Any, fault: str) -> None:
    engine, workers = fragile
    runner = EngineRunner(engine)
    runner.start(load_timeout_s=10)  # load() again: a fresh session
    victim = workers[1]
    faulted_at: list[float] = []
    first_tokens = 0

    def fault_once_all_decode() -> None:
        # the fault lands once every stream has a token, however slow a loaded machine is
        nonlocal first_tokens
        first_tokens += 1
        if first_tokens == 8:
            if fault == "kill":
                victim.popen.kill()
            else:
                os.kill(victim.pid, signal.SIGSTOP)
            faulted_at.append(time.monotonic())

    try:
        outcomes = run_all(runner, long_requests(engine), on_first_token=fault_once_all_decode)
        assert faulted_at  # every stream was decoding when its stage went
        elapsed = time.monotonic() - faulted_at[0]
        assert [outcome.finish for outcome in outcomes] == ["error"] * 8
        assert all("pipeline stage lost" in (outcome.error or "") for outcome in outcomes)
        assert elapsed < engine.token_timeout_s + 3
        assert not engine.healthy()
    finally:
        if fault == "freeze":
            wake(victim.pid)  # only the frozen one: the killed one is being reaped
        runner.close()


# -- losing a stage while speculating ------------------------------------------------------------


class Tripwire:
    """A drafter factory: its drafters draft `script` (plain decoding's tokens, some wrong);
    the `kill_on`-th draft kills `victim` (SIGKILL) before its VERIFY frame is sent."""

    def __init__(self) -> None:
        self.script: list[int] = []  # none yet: a sequence drafts nothing
        self.victim: StageProcess | None = None
        self.kill_on = 0
        self.drafts = 0
        self.killed_at: float | None = None

    def __call__(self, tokens: list[int]) -> ScriptedDrafter:
        return TrippingDrafter(self, tokens)

    def arm(self, script: list[int], victim: StageProcess, kill_on: int) -> None:
        self.script, self.victim, self.kill_on = script, victim, kill_on

    def drafted(self) -> None:
        self.drafts += 1
        if self.victim is not None and self.drafts == self.kill_on:
            self.killed_at = time.monotonic()
            self.victim.popen.kill()
            self.victim.popen.wait(5)


class TrippingDrafter(ScriptedDrafter):
    def __init__(self, tripwire: Tripwire, tokens: list[int]) -> None:
        super().__init__(tripwire.script, tokens)
        self.tripwire = tripwire

    def draft(self, most: int) -> list[int]:
        guesses = super().draft(most)
        if guesses:  # a verifying pass goes out with it
            self.tripwire.drafted()
        return guesses


@pytest.fixture
def tripwire() -> Tripwire:
    return Tripwire()


@pytest.fixture
def speculating(
    five_layer_model: Path, cluster_key: bytes, tmp_path: Path, tripwire: Tripwire
) -> Iterator[Any]:
    yield from open_fragile(
        five_layer_model, cluster_key, tmp_path, most_drafted=4, drafter=tripwire
    )


def test_a_stage_killed_under_a_verifying_pass_ends_the_stream_with_an_error(
    speculating: Any, tripwire: Tripwire
) -> None:
    """The last stage dies as the 4th draft goes out: the VERIFY frame passes stage 1 and is
    lost at stage 2. The stream ends with an error within the token timeout, not a hang, and
    the engine is unhealthy (what makes the supervisor re-plan)."""
    engine, workers = speculating
    runner = EngineRunner(engine)
    runner.start(load_timeout_s=10)  # load() again: a fresh session
    try:
        prompt = tuple(engine.tokenizer.encode(PROMPTS[1]))
        plain = run(runner, GenerationRequest("plain", prompt, max_tokens=32))  # drafts nothing
        assert "speculation" in engine.info().detail and tripwire.drafts == 0
        tripwire.arm([*prompt, *plain.tokens], workers[-1], kill_on=4)
        doomed = run(runner, GenerationRequest("doomed", prompt, max_tokens=100_000))
        ended = time.monotonic()
        assert tripwire.killed_at is not None, "no 4th draft was made"
        counts = engine.info().detail["speculation"]
        assert 0 < counts["accepted"] < counts["drafted"]  # three passes verified before it
        assert doomed.finish == "error"
        assert "pipeline stage lost" in (doomed.error or ""), doomed.error
        assert doomed.tokens == plain.tokens[: len(doomed.tokens)]  # plain decoding's, so far
        assert ended - tripwire.killed_at < engine.token_timeout_s + 1
        assert not engine.healthy()
    finally:
        runner.close()
