"""`tandem serve` with a long --context-tokens on a machine whose memory holds 3 such sequences,
not the 16 of a full batch: it serves 3 at once (the plan and /v1/cluster say so), and a fourth
concurrent request waits in the queue until one of the first three has finished."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from engines.model.info import inspect_model
from planner import single_need
from tests.helpers.serve import ServeProcess, start_serve

pytestmark = pytest.mark.cluster

KEY = "tandem-" + "A" * 43
CONTEXT = 8192  # the demo's KV: 4 KB a token, 32 MB a sequence
FIRST_TOKENS = (200, 600, 600)  # the first three; the shortest frees its place first
WAIT_S = 60.0


def memory_for_three(model: Path) -> int:
    """Between what 3 sequences of CONTEXT need and what 4 do, as the planner counts them."""
    shape = inspect_model(model).to_shape()
    three, four = single_need(shape, 3 * CONTEXT), single_need(shape, 4 * CONTEXT)
    return (three + four) // 2


class Stream:
    """One streamed completion on a thread: when its first text and its end arrived."""

    def __init__(self, server: ServeProcess, prompt: str, max_tokens: int) -> None:
        self.first_text_at: float | None = None
        self.ended_at: float | None = None
        self.finish: str | None = None
        body = {
            "model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True,
        }  # fmt: skip
        self.thread = threading.Thread(target=self._read, args=(server.base_url, body))
        self.thread.start()

    def _read(self, base_url: str, body: dict) -> None:
        url = f"{base_url}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=WAIT_S) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[len("data: ") :])["choices"][0]
                if choice.get("text") and self.first_text_at is None:
                    self.first_text_at = time.monotonic()
                if choice.get("finish_reason"):
                    self.finish, self.ended_at = choice["finish_reason"], time.monotonic()

    def join(self) -> None:
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive() and self.finish is not None


def wait_for_batch(server: ServeProcess, active: int, queued: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        batch = server.cluster()["engine"]["batch"]
        if (batch["active"], batch["queued"]) == (active, queued):
            return
        time.sleep(0.01)
    pytest.fail(f"never {active} running and {queued} queued: last {batch}")


def test_a_long_context_serves_the_sequences_that_fit_and_queues_the_rest(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    flags = [
        "--parallelism", "single", "--model-id", "demo", "--context-tokens", str(CONTEXT),
        "--memory-limit", str(memory_for_three(demo_model_dir)), "--prefix-cache-bytes", "0",
    ]  # fmt: skip
    server = start_serve(tmp_path, demo_model_dir, KEY, flags)
    try:
        cluster = server.cluster()
        first = [Stream(server, f"Story {n}:", tokens) for n, tokens in enumerate(FIRST_TOKENS)]
        wait_for_batch(server, 3, 0)
        fourth = Stream(server, "Story 3:", 16)
        wait_for_batch(server, 3, 1)  # a fourth waits while the first three run
        for stream in [*first, fourth]:
            stream.join()
    finally:
        server.stop()
    plan = cluster["plan"]
    assert (plan["batch_capacity"], plan["max_batch"], plan["refusal"]) == (3, 16, None)
    capacity = "batch capacity: 3 sequences x 8192 tokens"
    assert cluster["reason"].endswith(f"; {capacity} (a full batch of 16 does not fit)")
    (check,) = [check for check in plan["checks"] if check["name"] == "batch capacity"]
    assert check["detail"].startswith("3 sequences x 8192 tokens: a full batch of 16 does not ")
    assert "(--memory-limit)" in check["detail"]  # the limit's numbers
    assert cluster["engine"]["batch"]["capacity"] == 3  # the runner's, as planned
    assert capacity in server.log_text()
    first_end = min(stream.ended_at for stream in first)
    assert fourth.first_text_at is not None and fourth.first_text_at > first_end
    assert fourth.ended_at > first_end
