"""Sealed pipelines on real stage processes for tests, with a SingleEngine twin to compare."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from discovery.cluster_key import format_key
from engines.core.engine_options import EngineOptions
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.pipeline.engine import EncryptedPipelineEngine
from engines.pipeline.stage_worker import StageProcess
from engines.single.engine import SingleEngine
from errors import EngineError
from tests.helpers.signals import wake

HOST = "127.0.0.1"
MAX_TOKENS = 64
PROMPTS = (
    "Hello there",
    "The quick brown fox jumps over",
    "Once upon a time, in a land far away, there lived",
    "1, 2, 3,",
)
LONG_PROMPT = "In the beginning the model read a very long prompt, sentence after sentence. " * 12


@dataclass
class Pipeline:
    """A loaded engine behind an EngineRunner, its stage workers, and its SingleEngine twin."""

    engine: EncryptedPipelineEngine
    runner: EngineRunner
    workers: list[StageProcess]
    reference: EngineRunner
    ranges: list[range]


@dataclass(frozen=True)
class Outcome:
    tokens: list[int]
    text: str
    finish: str | None
    error: str | None
    completion_tokens: int


# -- helpers -------------------------------------------------------------------------------------


def start_workers(
    model_dir: Path,
    ranges: list[range],
    key: bytes,
    log_dir: Path,
    read_timeout_s: float = 10.0,
    stage_options: dict[str, Any] | None = None,
) -> tuple[socket.socket, list[StageProcess]]:
    """The coordinator's return listener and a worker per stage 1.., started last to first;
    `stage_options` are every stage's EngineOptions (e.g. kv_bits)."""
    listener = socket.create_server((HOST, 0))
    next_port = listener.getsockname()[1]
    workers: list[StageProcess] = []
    try:
        for index in reversed(range(1, len(ranges))):
            layers = ranges[index]
            spec = {
                "model_path": str(model_dir),
                "layers": [layers.start, layers.stop],
                "is_last": index == len(ranges) - 1,
                "listen_host": HOST,
                "listen_port": 0,
                "next_host": HOST,
                "next_port": next_port,
                "cluster_key": key.hex() if index % 2 else format_key(key),
                "read_timeout_s": read_timeout_s,
                "options": EngineOptions(**(stage_options or {})).document(),
            }
            with open(log_dir / f"stage{index}.log", "ab") as log:
                worker = StageProcess.start(spec, stderr=log, ready_timeout_s=60)
            workers.insert(0, worker)
            next_port = worker.port
    except BaseException:
        stop_workers(workers)
        listener.close()
        raise
    return listener, workers


def stop_workers(workers: list[StageProcess]) -> None:
    for worker in workers:
        if worker.popen.poll() is None:
            wake(worker.pid)  # in case a test froze it
        worker.stop(timeout_s=5)


def make_engine(
    model_dir: Path,
    ranges: list[range],
    key: bytes,
    listener: socket.socket | None,
    workers: list[StageProcess],
    **arguments: Any,
) -> EncryptedPipelineEngine:
    """The engine over `workers`; the `arguments` that are EngineOptions fields (kv_bits,
    prefill_chunk, ...) become its options, the others go to its constructor."""
    names = set(EngineOptions.__slots__)
    options = EngineOptions(**{k: v for k, v in arguments.items() if k in names})
    rest = {k: v for k, v in arguments.items() if k not in names}
    stages = [
        {"host": HOST, "port": worker.port, "layers": [layers.start, layers.stop]}
        for worker, layers in zip(workers, ranges[1:], strict=True)
    ]
    return EncryptedPipelineEngine(
        model_dir, ranges[0], stages, HOST, key, options=options, return_listener=listener, **rest
    )


async def collect(
    runner: EngineRunner,
    request: GenerationRequest,
    cancel_after: int | None = None,
    on_first_token: Callable[[], None] | None = None,
) -> Outcome:
    """Submit through the runner and collect the event stream (cancel after N tokens if asked;
    call on_first_token when the first token arrives)."""
    submission = runner.submit(request)
    tokens: list[int] = []
    texts: list[str] = []
    async for event in submission.events():
        if event.token is not None:
            tokens.append(event.token)
            if len(tokens) == 1 and on_first_token is not None:
                on_first_token()
            if cancel_after is not None and len(tokens) == cancel_after:
                submission.cancel()
        texts.append(event.text)
        if event.finish_reason is not None:
            return Outcome(
                tokens, "".join(texts), event.finish_reason, event.error, event.completion_tokens
            )
    raise AssertionError("the event stream ended without a final event")


def run(
    runner: EngineRunner, request: GenerationRequest, cancel_after: int | None = None
) -> Outcome:
    """One request through the runner, alone."""
    return asyncio.run(asyncio.wait_for(collect(runner, request, cancel_after), timeout=60))


def run_all(
    runner: EngineRunner,
    requests: list[GenerationRequest],
    cancel_after: dict[int, int] | None = None,
    on_first_token: Callable[[], None] | None = None,
) -> list[Outcome]:
    """Submit every request at once (a burst) and collect each stream; request i is cancelled
    after cancel_after[i] tokens; on_first_token is called as each stream's first arrives."""
    cancel_after = cancel_after or {}

    async def burst() -> list[Outcome]:
        return list(
            await asyncio.gather(
                *(
                    collect(runner, request, cancel_after.get(index), on_first_token)
                    for index, request in enumerate(requests)
                )
            )
        )

    return asyncio.run(asyncio.wait_for(burst(), timeout=90))


def make_request(
    runner: EngineRunner, prompt: str, max_tokens: int = MAX_TOKENS, **sampling: Any
) -> GenerationRequest:
    tokens = tuple(runner.engine.tokenizer.encode(prompt))
    return GenerationRequest(
        request_id=f"test-{prompt[:12]}", prompt_tokens=tokens, max_tokens=max_tokens, **sampling
    )


def assert_same(pipeline: Pipeline, request: GenerationRequest) -> Outcome:
    expected = run(pipeline.reference, request)
    got = run(pipeline.runner, request)
    assert expected.finish in ("stop", "length")
    assert got.tokens == expected.tokens  # the stream, token for token
    assert got.text == expected.text  # what a non-streaming response returns
    assert (got.finish, got.completion_tokens) == (expected.finish, expected.completion_tokens)
    return got


def open_pipeline(
    model_dir: Path, ranges: list[range], key: bytes, log_dir: Path, **options: Any
) -> Iterator[Pipeline]:
    listener, workers = start_workers(model_dir, ranges, key, log_dir)
    engine = make_engine(model_dir, ranges, key, listener, workers, **options)
    runner = EngineRunner(engine)
    reference = EngineRunner(SingleEngine(model_dir))
    try:
        runner.start(load_timeout_s=60)
        reference.start(load_timeout_s=60)
        yield Pipeline(engine, runner, workers, reference, ranges)
    finally:
        runner.close()
        reference.close()
        engine.close()
        stop_workers(workers)


def status(pipeline: Pipeline) -> list[dict[str, Any]]:
    """A STATUS roll call once the runner has handed its last removals to the engine."""
    deadline = time.monotonic() + 5
    while True:
        try:
            return pipeline.engine.stage_status()
        except EngineError as error:  # the runner's last remove() may still be on its way
            if "runs" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)
