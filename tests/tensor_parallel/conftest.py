"""Fixtures the tensor-parallel tests share: a SingleEngine to compare with and one two-rank
ring group. Package-scoped: each starts once for every module that uses it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.core.runner import EngineRunner
from engines.single.engine import SingleEngine
from tests.helpers.tensor_parallel import LOAD_TIMEOUT_S, Cluster, close_cluster, open_cluster

# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="package")
def single_runner(demo_model_dir: Path) -> Iterator[EngineRunner]:
    runner = EngineRunner(SingleEngine(demo_model_dir))
    runner.start(LOAD_TIMEOUT_S)
    yield runner
    runner.close()


@pytest.fixture(scope="package")
def cluster(demo_model_dir: Path) -> Iterator[Cluster]:
    cluster = open_cluster(demo_model_dir)
    yield cluster
    close_cluster(cluster)


@pytest.fixture(scope="package")
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
