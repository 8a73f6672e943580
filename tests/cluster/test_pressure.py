"""Pressure eviction: the runner's eviction hook (real SingleEngine), the controller's rounds and
refusals (scripted engine and tiers), and the API's 503 + Retry-After at critical."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from discovery.control import MemoryReport
from discovery.members import CONNECTED, LOST
from discovery.memory_tiers import CRITICAL, OK, WARN
from engines.cluster.pressure import PressureController, PressureSettings, plan_tiers
from engines.core.engine import Engine, StepOutput
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.core.service import Service
from engines.single.engine import SingleEngine
from errors import OverloadedError
from tests.helpers.api import (  # noqa: F401
    anyio_backend,
    assert_error,
    chat_body,
    make_service,
    open_client,
    parse_sse,
)
from tests.helpers.engine import run_one
from tests.helpers.supervision import ScriptedEngine

WAIT_S = 10.0
RUNNER_THREAD = "engine-core"  # the scheduler thread that owns the engine


def wait_until(predicate, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class CountingEngine(SingleEngine):
    """SingleEngine that records every eviction call: its keep_fraction, its thread, whether a
    step was running, and how many steps had run. `hold` parks the next step until released."""

    def __init__(self, model_dir: Path, freed: int = 4096, fail: bool = False) -> None:
        super().__init__(model_dir)
        self.freed = freed
        self.fail = fail
        self.evictions: list[tuple[float, str, bool, int]] = []
        self.in_step = False
        self.steps_run = 0
        self.hold = threading.Event()
        self.holding = threading.Event()
        self.release = threading.Event()

    def step(self) -> list[StepOutput]:
        self.in_step = True
        try:
            if self.hold.is_set():
                self.hold.clear()
                self.holding.set()
                self.release.wait(WAIT_S)
            return super().step()
        finally:
            self.in_step = False
            self.steps_run += 1

    def evict_prefix_cache(self, keep_fraction: float) -> int:
        thread = threading.current_thread().name
        self.evictions.append((keep_fraction, thread, self.in_step, self.steps_run))
        if self.fail:
            raise RuntimeError("the scripted eviction failed")
        return self.freed


@pytest.fixture
def counting(demo_model_dir: Path) -> Iterator[tuple[CountingEngine, EngineRunner]]:
    engine = CountingEngine(demo_model_dir)
    runner = EngineRunner(engine)
    runner.start(load_timeout_s=120)
    try:
        yield engine, runner
    finally:
        runner.close()


def long_request(engine: Engine, max_tokens: int = 120) -> GenerationRequest:
    prompt = tuple(engine.tokenizer.encode("Pressure is a fact of life"))
    return GenerationRequest("long", prompt, max_tokens)


# -- the runner's eviction hook ---------------------------------------------------------------


def test_an_idle_runner_wakes_up_to_evict(counting: tuple[CountingEngine, EngineRunner]) -> None:
    engine, runner = counting
    assert runner.idle and engine.evictions == []
    runner.request_prefix_eviction(0.5)
    wait_until(lambda: runner.prefix_evictions == 1)
    assert engine.evictions == [(0.5, RUNNER_THREAD, False, 0)]
    assert runner.prefix_evicted_bytes == 4096


def test_eviction_mid_stream_runs_between_steps_and_changes_no_token(
    counting: tuple[CountingEngine, EngineRunner],
) -> None:
    engine, runner = counting
    expected = run_one(runner, long_request(engine)).tokens

    async def stream_and_evict() -> list[int]:
        submission = runner.submit(long_request(engine))
        tokens: list[int] = []
        async for event in submission.events():
            if event.token is not None:
                tokens.append(event.token)
                if len(tokens) == 20:  # park a step mid-stream, ask from the loop's thread
                    engine.hold.set()
                    assert await asyncio.to_thread(engine.holding.wait, WAIT_S)
                    runner.request_prefix_eviction(0.0)
                    engine.release.set()
        return tokens

    steps_before = engine.steps_run
    assert asyncio.run(asyncio.wait_for(stream_and_evict(), 120)) == expected
    [(keep, thread, during_step, steps_run)] = engine.evictions
    assert (keep, thread, during_step) == (0.0, RUNNER_THREAD, False)
    assert steps_before + 20 < steps_run < engine.steps_run  # right after the parked step


def test_requests_made_during_one_step_merge_into_the_smallest_keep(
    counting: tuple[CountingEngine, EngineRunner],
) -> None:
    engine, runner = counting
    engine.hold.set()
    finished = threading.Thread(target=run_one, args=(runner, long_request(engine, 8)))
    finished.start()
    try:
        assert engine.holding.wait(WAIT_S)
        for keep in (0.5, 0.25, 0.75):
            runner.request_prefix_eviction(keep)
    finally:
        engine.release.set()
    finished.join(WAIT_S * 4)
    wait_until(lambda: runner.prefix_evictions == 1)
    assert [(keep, during) for keep, _, during, _ in engine.evictions] == [(0.25, False)]


def test_a_failed_eviction_leaves_the_runner_serving(demo_model_dir: Path) -> None:
    engine = CountingEngine(demo_model_dir, fail=True)
    runner = EngineRunner(engine)
    runner.start(load_timeout_s=120)
    try:
        runner.request_prefix_eviction(0.5)
        wait_until(lambda: len(engine.evictions) == 1)
        outcome = run_one(runner, long_request(engine, 6))
        assert (outcome.finish, len(outcome.tokens)) == ("length", 6)
        assert runner.prefix_evictions == 0  # only evictions that ran are counted
        with pytest.raises(ValueError, match="keep_fraction"):
            runner.request_prefix_eviction(1.5)
    finally:
        runner.close()
    runner.request_prefix_eviction(0.5)  # after close: ignored, nothing raised
    assert len(engine.evictions) == 1


# -- the controller ---------------------------------------------------------------------------


class ScriptedTiers:
    """The tiers the controller reads; a test sets them between ticks."""

    def __init__(self) -> None:
        self.tiers = {"coordinator": OK, "agent": OK}

    def __call__(self) -> dict[str, str]:
        return dict(self.tiers)


@pytest.fixture
def controlled() -> Iterator[tuple[PressureController, ScriptedTiers, ScriptedEngine, Service]]:
    engine = ScriptedEngine()
    runner = EngineRunner(engine)
    runner.start(load_timeout_s=WAIT_S)
    service = Service(model_id="m", tokenizer=None, runner=runner, state="ok")
    tiers = ScriptedTiers()
    settings = PressureSettings(eviction_interval_s=2.0, retry_after_s=7)
    controller = PressureController(service, tiers, settings)
    service.pressure = controller
    try:
        yield controller, tiers, engine, service
    finally:
        runner.close()


def evictions_after(engine: ScriptedEngine, count: int) -> list[float]:
    wait_until(lambda: len(engine.evictions) >= count)
    return list(engine.evictions)


def test_warn_evicts_in_rounds_until_every_node_is_ok(controlled) -> None:
    controller, tiers, engine, service = controlled
    assert controller.tick(now=0.0) == OK
    tiers.tiers["agent"] = WARN
    assert controller.tick(now=10.0) == WARN
    assert evictions_after(engine, 1) == [0.5]
    controller.tick(now=11.0)  # within the interval: the last eviction may not show yet
    for count, now in enumerate((12.0, 14.0, 16.0, 18.0), start=2):
        controller.tick(now=now)
        evictions_after(engine, count)  # one at a time: requests that meet would merge
    # past the schedule, its last step (keep nothing) repeats
    assert engine.evictions == [0.5, 0.5, 0.5, 0.0, 0.0]
    tiers.tiers["agent"] = OK
    assert controller.tick(now=19.0) == OK
    tiers.tiers["coordinator"] = WARN  # a new episode starts from the top at once
    controller.tick(now=19.5)
    assert evictions_after(engine, 6)[-1] == 0.5
    described = controller.describe()
    assert (described["episodes"], described["eviction_requests"]) == (2, 6)
    assert described["engine_evictions"] == 6 and described["engine_evicted_bytes"] == 600
    assert not described["refusing_new_requests"]
    controller.check_admission()  # warn alone refuses nothing


def test_critical_refuses_new_requests_with_retry_after_until_it_ends(controlled) -> None:
    controller, tiers, engine, service = controlled
    tiers.tiers["agent"] = CRITICAL
    assert controller.tick(now=0.0) == CRITICAL
    assert evictions_after(engine, 1) == [0.5]  # critical evicts too
    with pytest.raises(OverloadedError, match="memory is critical on agent") as refused:
        service.submit(GenerationRequest("r", (1, 2), 4))
    assert refused.value.retry_after_s == 7
    health = service.health()
    assert (health["status"], health["memory_tier"]) == ("overloaded", CRITICAL)
    assert health["memory_tiers"] == {"coordinator": OK, "agent": CRITICAL}
    assert "agent" in health["reason"]
    assert controller.describe()["refused_requests"] == 1

    tiers.tiers["agent"] = WARN
    controller.tick(now=1.0)
    controller.check_admission()  # warn: accepted again
    assert service.health()["status"] == "ok"


def test_no_runner_no_eviction_request(controlled) -> None:
    controller, tiers, engine, service = controlled
    runner = service.runner
    service.swap_runner(None, "degraded", "re-planning")
    tiers.tiers["agent"] = WARN
    controller.tick(now=0.0)
    service.swap_runner(runner, "ok")
    assert controller.eviction_requests == 0
    controller.tick(now=0.1)  # the runner is back: the episode's first request goes out
    assert evictions_after(engine, 1) == [0.5]


def test_the_background_thread_ticks(controlled) -> None:
    controller, tiers, engine, _ = controlled
    controller.settings = PressureSettings(check_interval_s=0.02)
    tiers.tiers["agent"] = WARN
    controller.start()
    try:
        wait_until(lambda: controller.tier == WARN and engine.evictions)
    finally:
        controller.close()


def member(node_id: str, tier: str | None, state: str = CONNECTED) -> SimpleNamespace:
    report = None if tier is None else MemoryReport(total=1, available=1, tandem_bytes=0, tier=tier)
    return SimpleNamespace(node_id=node_id, state=state, memory=report)


def test_plan_tiers_counts_only_the_nodes_the_plan_runs_on() -> None:
    plan = SimpleNamespace(ranks=("coord", "a"), stages=(SimpleNamespace(node_id="b"),))
    members = [
        member("a", WARN),
        member("b", None),  # no report yet: not counted
        member("c", CRITICAL),  # not in the plan
        member("a-lost", CRITICAL, state=LOST),
    ]
    assert plan_tiers(plan, "coord", OK, members) == {"coord": OK, "a": WARN}
    assert plan_tiers(None, "coord", CRITICAL, members) == {"coord": CRITICAL}


# -- through the API --------------------------------------------------------------------------


@pytest.mark.anyio
async def test_at_critical_a_running_stream_finishes_and_new_requests_get_503(
    demo_model_dir: Path,
) -> None:
    runner = EngineRunner(SingleEngine(demo_model_dir))
    runner.start(load_timeout_s=120)
    tiers = ScriptedTiers()
    service = make_service(runner)
    service.pressure = PressureController(service, tiers, PressureSettings(retry_after_s=3))
    try:
        async with open_client(service) as client:
            async with client.stream(
                "POST", "/v1/chat/completions", json=chat_body(max_tokens=200, stream=True)
            ) as stream:
                chunks = stream.aiter_text()
                first = await anext(chunks)  # the stream is running
                tiers.tiers["agent"] = CRITICAL
                service.pressure.tick()
                refused = await client.post("/v1/chat/completions", json=chat_body())
                error = assert_error(refused, 503, type="server_error", code="memory_pressure")
                assert refused.headers["retry-after"] == "3"
                assert "agent" in error["message"] and "retry" in error["message"]
                health = await client.get("/health")
                assert health.status_code == 503
                assert health.json()["status"] == "overloaded"
                assert health.json()["memory_tiers"]["agent"] == CRITICAL
                text = first + "".join([part async for part in chunks])
            events = parse_sse(text)
            assert events[-1] == "[DONE]"
            finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
            assert finish[-1] == "length"  # the request in flight was not lost

            tiers.tiers["agent"] = OK
            service.pressure.tick()
            accepted = await client.post("/v1/chat/completions", json=chat_body())
            assert accepted.status_code == 200, accepted.text
            assert (await client.get("/health")).json()["memory_tier"] == OK
    finally:
        runner.close()
