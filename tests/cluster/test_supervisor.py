"""The supervisor's lifecycle with a scripted engine: races reproduced with events, not sleeps."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from engines.cluster import supervisor as supervisor_module
from engines.cluster.exclusions import FIRST_EXCLUSION_S, MemberExclusions
from engines.core.engine import Engine, StepOutput
from engines.core.request import GenerationRequest
from engines.core.scheduler import BatchScheduler
from errors import EngineError
from tests.helpers.supervision import WAIT_S, Members, ScriptedEngine, make_supervisor


def test_a_replan_closes_the_old_runner_even_when_the_watcher_runs_in_between(
    demo_model_dir, monkeypatch
):
    # Only the re-plan this test starts may run: the real watch thread, waking on its own,
    # could close the retired runner by luck and hide the race.
    monkeypatch.setattr(supervisor_module, "WATCH_INTERVAL_S", 60.0)
    engines: list[ScriptedEngine] = []
    supervisor = make_supervisor(
        demo_model_dir, lambda plan: engines.append(ScriptedEngine()) or engines[-1]
    )
    supervisor.start()
    old_runner = supervisor.service.runner
    swap = supervisor.service.swap_runner
    watcher: list[threading.Thread] = []

    def swap_then_let_the_watcher_run(*args: Any) -> None:
        swap(*args)
        if watcher:  # once: the re-plan's own swap must not start another one
            return
        # The watcher wakes right here, as it could before the fix: run its re-plan now.
        thread = threading.Thread(target=supervisor._replan)
        watcher.append(thread)
        thread.start()
        thread.join(0.5)  # with the fix it waits for request_replan to finish

    supervisor.service.swap_runner = swap_then_let_the_watcher_run  # type: ignore[method-assign]
    try:
        supervisor.request_replan("member agent-0 lost")
        supervisor.service.swap_runner = swap  # type: ignore[method-assign]
        watcher[0].join(WAIT_S)
        assert engines[0].closed.wait(WAIT_S), "the retired runner was never closed"
        assert old_runner.core._scheduler._thread.is_alive() is False
    finally:
        supervisor.service.swap_runner = swap  # type: ignore[method-assign]
        supervisor.close()


def test_a_member_lost_while_a_replan_launches_is_not_forgotten(demo_model_dir, monkeypatch):
    # Only the re-plan this test starts may run: the watch thread, waking on its own, would
    # re-plan for the second loss itself and clear the flag this test reads (a CI run did).
    monkeypatch.setattr(supervisor_module, "WATCH_INTERVAL_S", 60.0)
    launching, proceed = threading.Event(), threading.Event()
    calls = 0

    def factory(plan: Any) -> Engine:
        nonlocal calls
        calls += 1
        if calls == 2:  # the re-plan's launch
            launching.set()
            proceed.wait(WAIT_S)
        return ScriptedEngine()

    supervisor = make_supervisor(demo_model_dir, factory, Members())
    supervisor.start()
    try:
        supervisor.request_replan("member agent-0 lost")
        replan = threading.Thread(target=supervisor._replan)
        replan.start()
        assert launching.wait(WAIT_S)
        supervisor.request_replan("member agent-1 lost")  # arrives mid-launch
        proceed.set()
        replan.join(WAIT_S)
        assert supervisor._replan_wanted.is_set(), "the second loss was dropped"
        assert supervisor.last_replan_reason == "member agent-1 lost"
    finally:
        supervisor.close()


def test_a_load_that_times_out_is_aborted_and_closed(demo_model_dir):
    engine = ScriptedEngine(gate=threading.Event())  # never opens by itself
    supervisor = make_supervisor(demo_model_dir, lambda plan: engine, ready_timeout_s=0.2)
    with pytest.raises(EngineError, match="did not load within 0.2 s"):
        supervisor.start()
    assert engine.aborted.is_set()
    assert engine.closed.wait(WAIT_S)  # closed by the runner once its load returned
    assert supervisor.service.runner is None
    supervisor.close()


def test_close_waits_for_a_launch_in_progress_and_installs_nothing(demo_model_dir):
    launching, proceed = threading.Event(), threading.Event()
    engines: list[ScriptedEngine] = []

    def factory(plan: Any) -> Engine:
        engines.append(ScriptedEngine())
        if len(engines) == 2:
            launching.set()
            proceed.wait(WAIT_S)
        return engines[-1]

    supervisor = make_supervisor(demo_model_dir, factory, Members())
    supervisor.start()
    supervisor.request_replan("member agent-0 lost")  # the watcher launches plan 2
    assert launching.wait(WAIT_S)
    closer = threading.Thread(target=supervisor.close)
    closer.start()
    time.sleep(0.1)  # close() is now waiting for the watcher
    proceed.set()
    closer.join(WAIT_S * 2)
    assert not closer.is_alive() and not supervisor._watcher.is_alive()
    assert supervisor.service.runner is None
    assert engines[1].closed.wait(WAIT_S), "the engine launched during close() leaked"


def test_failed_replans_back_off_instead_of_retrying_every_two_seconds(demo_model_dir, monkeypatch):
    # long enough that a loaded machine's scheduling noise (tens of ms) cannot hide the doubling
    monkeypatch.setattr(supervisor_module, "RETRY_FIRST_S", 0.15)
    monkeypatch.setattr(supervisor_module, "RETRY_MAX_S", 1.2)
    attempts: list[float] = []

    def factory(plan: Any) -> Engine:
        attempts.append(time.monotonic())
        if len(attempts) == 1:
            return ScriptedEngine()
        raise EngineError("the worker refused the plan")

    supervisor = make_supervisor(demo_model_dir, factory, Members())
    supervisor.start()
    supervisor.request_replan("member agent-0 lost")
    deadline = time.monotonic() + 10.0  # four retries take ~2.25 s; a loaded host, longer
    while len(attempts) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    supervisor.close()
    gaps = [later - earlier for earlier, later in zip(attempts[1:], attempts[2:], strict=False)]
    assert len(gaps) >= 3
    assert gaps[1] > gaps[0] * 1.5 and gaps[2] > gaps[1] * 1.5  # doubling, not a fixed pace
    assert supervisor.service.state == "stopping"


def test_a_member_whose_worker_keeps_failing_sits_out_with_its_reason(demo_model_dir):
    supervisor = make_supervisor(demo_model_dir, lambda plan: ScriptedEngine(), Members())
    assert len(supervisor.make_plan().ranks) == 3
    supervisor.exclusions.record_failure("agent-1", "ValueError: bad shard")
    assert len(supervisor.make_plan().ranks) == 3  # one failure may be bad luck
    supervisor.exclusions.record_failure("agent-1", "ValueError: bad shard")
    plan = supervisor.make_plan()
    assert "agent-1" not in plan.ranks and len(plan.ranks) == 2
    (excluded,) = supervisor.status()["excluded"]
    assert excluded["node_id"] == "agent-1" and excluded["reason"] == "ValueError: bad shard"
    assert 0 < excluded["excluded_for_s"] <= FIRST_EXCLUSION_S


def test_a_lost_member_is_named_by_its_part_in_the_plan(demo_model_dir):
    engines: list[ScriptedEngine] = []
    supervisor = make_supervisor(
        demo_model_dir, lambda plan: engines.append(ScriptedEngine()) or engines[-1], Members()
    )
    supervisor.start()
    try:
        (stage,) = [s for s in supervisor.plan.stages if s.node_id == "agent-1"]
        index = supervisor.plan.stages.index(stage)
        supervisor.on_assignment_failed("agent-1", "a1", "its worker froze for 3.0 s")
        expected = (
            f"pipeline stage {index} (layers [{stage.layers.start}, {stage.layers.stop})) "
            "on node agent-1 failed: its worker froze for 3.0 s"
        )
        assert supervisor.last_replan_reason == expected
        assert engines[0].aborted.is_set()  # the engine hears the same reason
    finally:
        supervisor.close()


def test_exclusions_grow_and_end():
    now = [100.0]
    exclusions = MemberExclusions(clock=lambda: now[0])
    for _ in range(3):
        exclusions.record_failure("a", "boom")
    assert exclusions.excluded_now() == {"a"}
    now[0] += FIRST_EXCLUSION_S + 1  # the third failure doubled the first back-off
    assert exclusions.excluded_now() == {"a"}
    now[0] += FIRST_EXCLUSION_S
    assert exclusions.excluded_now() == set()


def test_the_core_closes_an_engine_only_after_its_step_returned():
    stepping, release = threading.Event(), threading.Event()

    class SlowStep(ScriptedEngine):
        def step(self) -> list[StepOutput]:
            stepping.set()
            release.wait(WAIT_S)
            assert not self.closed.is_set(), "closed while a step was running"
            return []

    engine = SlowStep()
    engine.tokenizer = type("T", (), {"detokenizer": None, "eos_token_ids": []})()
    scheduler = BatchScheduler(engine, max_batch=2, sink=lambda report: None)
    scheduler.start(WAIT_S)
    scheduler.add(0, GenerationRequest("r", (1, 2), max_tokens=4))  # one running: it steps
    assert stepping.wait(WAIT_S)
    scheduler.close(join_timeout_s=0.1)  # the step is still running: close must not close it
    assert not engine.closed.is_set()
    release.set()
    assert engine.closed.wait(WAIT_S)


def test_replans_are_kept_in_the_history_and_counted_by_kind(demo_model_dir):
    supervisor = make_supervisor(demo_model_dir, lambda plan: ScriptedEngine(), Members())
    supervisor.start()
    try:
        supervisor.request_replan("member agent-0 lost: its worker failed: exit 3")
        supervisor._replan()
        status = supervisor.status()
        (entry,) = status["replan_history"]
        assert entry["kind"] == "worker_failed" and entry["strategy"] == "pp"
        assert entry["reason"] == "member agent-0 lost: its worker failed: exit 3"
        assert status["replans_by_reason"] == {"worker_failed": 1}
    finally:
        supervisor.close()
