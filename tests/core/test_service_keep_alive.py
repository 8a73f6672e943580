"""--keep-alive takes a model's runner only when nothing was submitted or claimed for the idle
time and nothing runs: a request that has found the runner keeps it (the race that gave a 503)."""

from __future__ import annotations

import asyncio
import time

from engines.core.runner import EngineRunner
from engines.core.service import Service
from engines.single.engine import SingleEngine
from tests.helpers.engine import collect, make_request


def test_a_claimed_or_busy_runner_is_kept_and_an_idle_one_taken(demo_model_dir) -> None:
    runner = EngineRunner(SingleEngine(demo_model_dir), queue_size=4, max_batch=4)
    runner.start(120)
    service = Service("demo", tokenizer=None, runner=runner, state="ok")
    try:
        assert service.claim()  # a request found the runner: used from now
        assert service.retire_if_idle(5.0, "unloading", "idle") is None
        assert service.runner is runner and service.state == "ok"

        async def busy() -> None:
            running = asyncio.create_task(collect(runner, make_request(runner.engine, "a", 64)))
            while runner.idle:
                await asyncio.sleep(0.001)
            assert service.retire_if_idle(0.0, "unloading", "idle") is None  # it runs
            await running

        asyncio.run(busy())
        deadline = time.monotonic() + 10
        while not runner.idle and time.monotonic() < deadline:  # the core lets it go
            time.sleep(0.01)
        taken = service.retire_if_idle(0.0, "unloading", "idle for 0 s")
        assert taken is runner
        assert (service.runner, service.state, service.state_reason) == (
            None, "unloading", "idle for 0 s",
        )  # fmt: skip
        assert not service.claim()  # a request now waits for the model to load again
    finally:
        runner.close()
