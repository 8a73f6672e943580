"""Fixtures the pipeline tests share: pipelines on real stage processes, and one live stage
worker to attack. Package-scoped: each starts once for every module that uses it."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from discovery.cluster_key import generate_key
from engines.pipeline.stage_worker import StageProcess
from planner import allocate_layers
from tests.helpers.live_stage import (
    HOST,
    LAST,
    READ_TIMEOUT_S,
    Chain,
    LiveStage,
    assert_fresh_session_serves,
)
from tests.helpers.pipeline import Pipeline, open_pipeline

# -- pipelines on real stage processes, each with a SingleEngine twin -----------------------------


@pytest.fixture(scope="package")
def cluster_key() -> bytes:
    return generate_key()


@pytest.fixture(scope="package")
def five_layer_model(demo_model_factory: Any) -> Path:
    return demo_model_factory(layers=5)


@pytest.fixture(scope="package")
def two_stages(
    demo_model_dir: Path, cluster_key: bytes, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    """The 4-layer demo model as [0, 2) here and [2, 4) in a worker; default 256-token chunks."""
    ranges = allocate_layers(4, [8, 8])
    yield from open_pipeline(
        demo_model_dir, ranges, cluster_key, tmp_path_factory.mktemp("two-stages")
    )


@pytest.fixture(scope="package")
def three_stages(
    five_layer_model: Path, cluster_key: bytes, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    """5 layers over unequal memory: an uneven split, and small chunks so prefill is chunked."""
    ranges = allocate_layers(5, [20, 6, 6])
    assert [len(r) for r in ranges] == [3, 1, 1]
    yield from open_pipeline(
        five_layer_model, ranges, cluster_key, tmp_path_factory.mktemp("three"), prefill_chunk=16
    )


@pytest.fixture(scope="package")
def relay(
    demo_model_dir: Path, cluster_key: bytes, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    """The 4-layer demo model alone in a worker; stage 0 here only embeds (planner/relay.py)."""
    yield from open_pipeline(
        demo_model_dir, [range(0), range(4)], cluster_key, tmp_path_factory.mktemp("relay")
    )


@pytest.fixture(params=["two_stages", "three_stages", "relay"])
def pipeline(request: pytest.FixtureRequest) -> Pipeline:
    return request.getfixturevalue(request.param)


# -- the live stage ------------------------------------------------------------------------------


@pytest.fixture(scope="package")
def stage(demo_model_factory: Callable[..., Path], tmp_path_factory) -> Iterator[LiveStage]:
    model = demo_model_factory(layers=5)
    key = generate_key()
    listener = socket.create_server((HOST, 0))
    log_path = tmp_path_factory.mktemp("tamper") / "stage.log"
    spec = {
        "model_path": str(model),
        "layers": [LAST.start, LAST.stop],
        "is_last": True,
        "listen_host": HOST,
        "listen_port": 0,
        "next_host": HOST,
        "next_port": listener.getsockname()[1],
        "cluster_key": key.hex(),
        "read_timeout_s": READ_TIMEOUT_S,
    }
    with open(log_path, "ab") as log:
        worker = StageProcess.start(spec, stderr=log, ready_timeout_s=60)
    try:
        yield LiveStage(worker, listener, log_path, key)
    finally:
        worker.stop(timeout_s=5)
        listener.close()


@pytest.fixture(scope="package")
def baseline(stage: LiveStage) -> list[int]:
    chain = Chain(stage)
    try:
        assert chain.setup() == [
            {"layers": [0, 4]},
            {
                "layers": [4, 5],
                "peak_memory_bytes": stage.worker.peak_memory_bytes,
                "active_requests": 0,
                "served_requests": 0,
                "prefix_entries": 0,
                "prefix_bytes": 0,
                "prefilled_tokens": 0,
            },
        ]
        return chain.first_tokens()
    finally:
        chain.close()


@pytest.fixture
def chain(stage: LiveStage, baseline: list[int]) -> Iterator[Chain]:
    """A set-up session; afterwards the stage must still run and serve a fresh one exactly."""
    session = Chain(stage)
    try:
        session.setup()
        yield session
    finally:
        session.close()
    assert stage.worker.popen.poll() is None, "the stage worker died"
    assert_fresh_session_serves(stage, baseline)
