"""The observability flags of `tandem serve`, and progress bars only on a terminal."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from cli.main import build_parser
from cli.observability import observability_from_args
from discovery.framing import free_port
from errors import ConfigError
from tests.helpers.cluster import REPO_ROOT, child_env


def serve_observability(argv: list[str], monkeypatch: pytest.MonkeyPatch, **env: str):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return observability_from_args(build_parser().parse_args(["serve", *argv]))


def test_defaults_log_nothing_and_keep_the_key_on_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    config = serve_observability([], monkeypatch)
    assert config.request_log is None and not config.request_log_stdout
    assert not config.request_log_prompts
    assert not config.metrics_open and not config.dashboard_open


def test_flags_and_their_environment_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    config = serve_observability(
        ["--request-log", "/tmp/requests.log", "--metrics-open", "on"],
        monkeypatch,
        TANDEM_REQUEST_LOG_PROMPTS="on",
        TANDEM_DASHBOARD_OPEN="on",
        TANDEM_REQUEST_LOG_BACKUPS="2",
    )
    assert config.request_log == Path("/tmp/requests.log")
    assert config.request_log_prompts and config.metrics_open and config.dashboard_open
    assert config.request_log_backups == 2
    to_stdout = serve_observability(["--request-log", "-"], monkeypatch)
    assert to_stdout.request_log is None and to_stdout.request_log_stdout
    with pytest.raises(ConfigError, match="request-log-backups"):
        serve_observability(["--request-log-backups", "-1"], monkeypatch)


def run_demo_model(path: Path, terminal: bool) -> str:
    """`tandem demo-model PATH` with its output on a pseudo-terminal (or a pipe)."""
    command = [sys.executable, "-m", "cli.main", "demo-model", str(path)]
    if not terminal:
        result = subprocess.run(
            command, cwd=REPO_ROOT, env=child_env(), capture_output=True, timeout=120, check=True
        )
        return (result.stdout + result.stderr).decode()
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, env=child_env(), stdout=secondary, stderr=secondary
    )
    os.close(secondary)
    output = b""
    try:
        while chunk := _read(primary):
            output += chunk
    finally:
        os.close(primary)
        process.wait(timeout=120)
    assert process.returncode == 0, output
    return output.decode(errors="replace")


def _read(descriptor: int) -> bytes:
    try:
        return os.read(descriptor, 4096)
    except OSError:  # the child closed the terminal
        return b""


def test_progress_bars_only_on_a_terminal(tmp_path: Path) -> None:
    assert "demo model:" in run_demo_model(tmp_path / "on-terminal", terminal=True)
    piped = run_demo_model(tmp_path / "piped", terminal=False)
    assert "demo model:" not in piped and "wrote llama demo model" in piped


def test_serve_counts_the_layers_it_loads_on_a_terminal(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """A real `tandem serve` on a pseudo-terminal: the engine-start bar counts the demo model's
    4 layers; stopped (SIGINT) as soon as it serves."""
    command = [
        *(sys.executable, "-m", "cli.main", "serve", "--model", str(demo_model_dir)),
        *("--parallelism", "single", "--port", str(free_port("127.0.0.1"))),
        *("--state-dir", str(tmp_path / "state")),
    ]
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    env = child_env() | {"TANDEM_INTERFACE": "127.0.0.1"}
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=secondary, stderr=secondary)
    os.close(secondary)
    output = b""
    deadline = time.monotonic() + 60
    try:
        while b"serving " not in output and time.monotonic() < deadline:
            if select.select([primary], [], [], 0.5)[0]:
                if not (chunk := _read(primary)):
                    break
                output += chunk
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        os.close(primary)
    text = output.decode(errors="replace")
    assert "serving " in text, text[-2000:]
    assert "starting the engine" in text and "3/4 layers" in text, text[-2000:]
