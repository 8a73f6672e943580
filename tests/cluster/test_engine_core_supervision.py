"""`tandem serve` supervises its engine-core process like a worker: a core that dies or
freezes ends every stream at once (within --lost-after + 1 s), a new core serves after a
re-plan, and a killed serve leaves no core behind."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from tests.helpers.cluster import AgentPool
from tests.helpers.serve import ServeProcess, start_serve

pytestmark = pytest.mark.cluster

LOST_AFTER_S = 3.0  # start_serve's --lost-after
RECOVER_S = 60.0


def core_of(server: ServeProcess) -> psutil.Process:
    """serve's engine-core child."""
    for child in psutil.Process(server.process.pid).children():
        if "engines.core.core_main" in " ".join(child.cmdline()):
            return child
    raise AssertionError("serve has no engine-core process")


def stream_then(server: ServeProcess, act: Callable[[], None]) -> tuple[str, float]:
    """Stream a long completion; run `act` after its first text; (the streamed error's
    message, seconds from `act` to it)."""
    body = {"model": "demo", "prompt": "go", "max_tokens": 4000, "stream": True}
    acted_at = None
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, timeout=60, trust_env=False
    ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                return chunk["error"]["message"], time.monotonic() - (acted_at or 0)
            if acted_at is None and chunk["choices"][0].get("text"):
                act()
                acted_at = time.monotonic()
    raise AssertionError("the stream ended without an error")


def wait_new_core(server: ServeProcess, old_pid: int) -> psutil.Process:
    deadline = time.monotonic() + RECOVER_S
    while time.monotonic() < deadline:
        status, body = server.get("/health")
        if status == 200 and body.get("status") == "ok":
            core = core_of(server)
            if core.pid != old_pid:
                return core
        time.sleep(0.2)
    raise AssertionError(f"no new engine core within {RECOVER_S} s:\n{server.log_text()}")


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_serve_replaces_a_core_that_died_or_froze_and_a_killed_serve_leaves_none(
    tmp_path: Path, pool: AgentPool, demo_model_dir: Path
) -> None:
    pool.start("a1", real_roles=True)
    server = start_serve(
        tmp_path, demo_model_dir, pool.cluster_key, ["--parallelism", "pp", "--model-id", "demo"]
    )
    try:
        for signum, within_s in ((signal.SIGKILL, 1.0), (signal.SIGSTOP, LOST_AFTER_S + 1.0)):
            core = core_of(server)
            error, after_s = stream_then(server, lambda c=core, s=signum: os.kill(c.pid, s))
            assert "engine core" in error, error
            assert after_s < within_s, f"{signum.name}: the stream ended {after_s:.1f} s later"
            core = wait_new_core(server, core.pid)
            assert server.cluster()["strategy"] == "pp"
            memory = server.cluster()["coordinator"]["memory_accounting"]
            assert memory["engine_core"]["weights"] > 0 and memory["api"]["weights"] == 0
            body = {"model": "demo", "prompt": "again", "max_tokens": 4}
            answer = httpx.post(
                f"{server.base_url}/v1/completions", json=body, timeout=60, trust_env=False
            )
            assert answer.status_code == 200, answer.text
        core = core_of(server)
        server.process.kill()
        deadline = time.monotonic() + LOST_AFTER_S
        while not gone(core) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(core), "the engine core outlived a killed serve"
    finally:
        server.stop()
