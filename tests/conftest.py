"""Shared fixtures: tiny deterministic demo models written once per test session."""

from __future__ import annotations

import os

# Intel's OpenMP (MKL's threads when a process has more than one BLAS thread) spins a thread that
# finished its part for 200 ms before it sleeps. With four workers' servers on two cores that
# spinning burned about a fifth of the suite's CPU, which the other workers' processes were
# waiting for. Every process a test starts inherits this; serving keeps the default, which is
# faster at one stream.
os.environ.setdefault("KMP_BLOCKTIME", "0")

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.cluster import AgentPool
from tests.helpers.demo_models import make_base_model, make_demo_model
from tests.helpers.serve import ServeProcess

# Under xdist (`make test`): a loopback per worker, process-heavy modules first, solo tests alone.
pytest_plugins = ["tests.helpers.workers"]

# Three heads: a model that tensor parallelism over two ranks cannot split.
ODD_HEADS = {"heads": 3, "kv_heads": 3}


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default demo model (llama, 4 layers, hidden 256, 8 heads, 4 kv heads)."""
    return make_demo_model(tmp_path_factory.mktemp("demo-default"))


@pytest.fixture(scope="session")
def base_model_dir(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default demo model as a base model's GGUF imported: a tokenizer with no template."""
    return make_base_model(demo_model_dir, tmp_path_factory.mktemp("base-model"))


@pytest.fixture(scope="session")
def odd_heads_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A llama demo model with 3 heads and 3 kv heads (hidden 96): not divisible by 2 ranks."""
    return make_demo_model(tmp_path_factory.mktemp("demo-odd-heads"), **ODD_HEADS)


@pytest.fixture(scope="session")
def thinking_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default demo model with <think> markers and a template that thinks (as Qwen3's)."""
    return make_demo_model(tmp_path_factory.mktemp("demo-thinking"), thinking=True)


@pytest.fixture(scope="session")
def demo_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make_demo_model bound to one session directory: equal overrides share one model."""
    root = tmp_path_factory.mktemp("demo-models")
    return lambda **overrides: make_demo_model(root, **overrides)


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[AgentPool]:
    """`tandem join` agents on 127.0.0.1, stopped after the test whatever happens."""
    agents = AgentPool(tmp_path / "agents")
    try:
        yield agents
    finally:
        agents.stop_all()


@pytest.fixture
def servers() -> Iterator[list[ServeProcess]]:
    """`tandem serve` processes a test started; each is stopped after it."""
    started: list[ServeProcess] = []
    try:
        yield started
    finally:
        for server in started:
            server.stop()
