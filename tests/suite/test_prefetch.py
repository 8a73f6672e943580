"""The suite's downloads happen before its workers go offline, never inside a test worker."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from discovery.directories import default_cache_dir
from engines.model.pypi_models import SMOLLM2
from tests.helpers import prefetch
from tests.helpers.npm_tools import npm_tool
from tests.helpers.real_models import smollm2_gguf
from tests.helpers.workers import ISOLATED, worker_id


@pytest.fixture
def offline_worker(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """This process as a worker without network; the commands anything tried to run."""
    monkeypatch.setenv(prefetch.OFFLINE_ENV, "1")
    spawned: list[list[str]] = []

    def refuse(command: list[str], *args: object, **kwargs: object) -> None:
        spawned.append(command)
        raise AssertionError(f"a test worker ran {command}")

    monkeypatch.setattr(subprocess, "run", refuse)
    return spawned


def test_a_missing_model_in_a_worker_is_one_line_and_no_download(
    tmp_path: Path, offline_worker: list[list[str]]
) -> None:
    with pytest.raises(pytest.fail.Exception) as failed:
        smollm2_gguf(tmp_path)
    message = str(failed.value)
    assert "\n" not in message
    assert "no network" in message and f"`{prefetch.FETCH_COMMAND}`" in message
    assert offline_worker == []  # pip never ran


def test_a_missing_npm_tool_in_a_worker_is_one_line_and_no_install(
    tmp_path: Path, offline_worker: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("npm and node are needed for npm_tool to look for an install (not on PATH)")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    package, version, binary = prefetch.NPM_TOOLS[0]
    with pytest.raises(pytest.fail.Exception) as failed:
        npm_tool(package, version, binary)
    message = str(failed.value)
    assert "\n" not in message and f"{package}@{version}" in message
    assert offline_worker == []  # npm never ran


def test_a_worker_is_offline_and_finds_what_the_controller_fetched(
    request: pytest.FixtureRequest,
) -> None:
    # Under `make test`: the worker's network is gone, so the model it finds was fetched
    # before it started. Should a fetch move back into the workers, this fails first.
    config = request.config
    isolated = worker_id(config) is not None and not config.stash.get(ISOLATED, "no")
    assert prefetch.offline() == isolated  # only an isolated worker refuses to fetch
    if isolated:
        assert SMOLLM2.gguf_path(default_cache_dir()).is_file()
