"""Command-line tools from npm for the tests (Codex CLI, Claude Code): installed once per
version into the user's cache; a skip that says why when npm is not there."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

INSTALL_TIMEOUT_S = 600


def npm_cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "tandem-tests" / "npm"


def npm_tool(package: str, version: str, binary: str) -> Path:
    """The path of `binary` from `package@version`, installed under the cache on first use.

    Skips the calling test, saying why, when npm is absent; a failed install fails it."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip(f"npm and node are needed to install {package} (not on PATH)")
    prefix = npm_cache_root() / f"{package.replace('/', '+')}@{version}"
    executable = prefix / "node_modules" / ".bin" / binary
    if executable.exists():
        return executable
    prefix.mkdir(parents=True, exist_ok=True)
    command = ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix)]
    try:
        finished = subprocess.run(
            [*command, f"{package}@{version}"],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"npm install {package}@{version} took over {INSTALL_TIMEOUT_S} s")
    if finished.returncode != 0 or not executable.exists():
        pytest.fail(f"npm install {package}@{version} failed: {finished.stderr[-500:]}")
    return executable
