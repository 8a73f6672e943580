"""Command-line tools from npm for the tests (Codex CLI, Claude Code): installed once per
version into the user's cache; a skip that says why when npm is not there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.prefetch import offline, refuse_fetch

INSTALL_TIMEOUT_S = 600
# A registry lookup that failed on the network (seen once: EAI_AGAIN for a minute) is tried
# again; any other failure fails the test at once.
INSTALL_ATTEMPTS = 3
RETRY_AFTER_S = 15.0
NETWORK_ERRORS = ("EAI_AGAIN", "ENOTFOUND", "ETIMEDOUT", "ECONNRESET", "ECONNREFUSED")


def npm_cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "tandem-tests" / "npm"


class NpmInstallError(RuntimeError):
    """npm could not install a tool (one line, npm's last words)."""


def npm_tool(package: str, version: str, binary: str) -> Path:
    """The path of `binary` from `package@version`, from the cache (installed there first
    outside a test worker: tests/helpers/prefetch.py).

    Skips the calling test, saying why, when npm is absent; a failed install fails it."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip(f"npm and node are needed to install {package} (not on PATH)")
    executable = _executable(package, version, binary)
    if executable.exists():
        return executable
    if offline():
        refuse_fetch(f"{package}@{version}")
    try:
        return install_npm_tool(package, version, binary)
    except NpmInstallError as error:
        pytest.fail(str(error), pytrace=False)


def _executable(package: str, version: str, binary: str) -> Path:
    prefix = npm_cache_root() / f"{package.replace('/', '+')}@{version}"
    return prefix / "node_modules" / ".bin" / binary


def install_npm_tool(package: str, version: str, binary: str, show_progress: bool = False) -> Path:
    """Install `package@version` into the cache unless it is there; its `binary`'s path."""
    executable = _executable(package, version, binary)
    if executable.exists():
        return executable
    prefix = executable.parent.parent.parent
    prefix.mkdir(parents=True, exist_ok=True)
    if show_progress:
        print(f"installing {package}@{version} into {prefix} (npm, once)", file=sys.stderr)
    command = ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix)]
    said = ""
    for attempt in range(INSTALL_ATTEMPTS):
        try:
            finished = subprocess.run(
                [*command, f"{package}@{version}"],
                capture_output=True,
                text=True,
                timeout=INSTALL_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise NpmInstallError(
                f"npm install {package}@{version} took over {INSTALL_TIMEOUT_S} s"
            ) from None
        if finished.returncode == 0 and executable.exists():
            return executable
        said = " ".join(finished.stderr.split())[-300:]
        if not any(error in finished.stderr for error in NETWORK_ERRORS):
            break
        time.sleep(RETRY_AFTER_S * (attempt + 1))  # a name lookup that failed may pass soon
    raise NpmInstallError(f"npm install {package}@{version} failed: {said}")
