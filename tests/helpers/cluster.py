"""Start and stop real `tandem join` agent processes on 127.0.0.1 for cluster tests.

Every process started here is stopped by AgentPool.stop_all() (use the pool in a fixture's
finally) and, as a last resort, at interpreter exit.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from discovery.cluster_key import format_key, generate_key

REPO_ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"
READY_PATTERN = re.compile(r"tandem join: node (\S+) ready on (\S+):(\d+)")
READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.05
FAKE_WORKER = "tests.helpers.fake_role_worker"
FAKE_WORKER_ROLES = (f"tp_rank={FAKE_WORKER}", f"pp_stage={FAKE_WORKER}")

_LIVE: set[subprocess.Popen] = set()


class AgentStartError(RuntimeError):
    """An agent exited or stayed silent instead of printing its ready line."""


def new_key_text() -> str:
    """A fresh cluster key in its text form."""
    return format_key(generate_key())


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tandem children: no inherited TANDEM_* settings, the repo importable."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_cli(args: Sequence[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run `tandem ARGS` to completion (e.g. peers), bounded by timeout_s."""
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


@dataclass
class AgentProcess:
    """One `tandem join` process; its stdout and stderr go to log_path."""

    process: subprocess.Popen
    log_path: Path
    state_dir: Path
    node_id: str = ""
    host: str = ""
    port: int = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> AgentProcess:
        """Poll the log for the ready line; AgentStartError (with the log) if it never comes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = READY_PATTERN.search(self.log_text())
            if match:
                self.node_id, self.host, self.port = (
                    match.group(1),
                    match.group(2),
                    int(match.group(3)),
                )
                return self
            if not self.alive:
                raise AgentStartError(
                    f"agent exited with {self.process.returncode} before ready:\n{self.log_text()}"
                )
            time.sleep(POLL_S)
        raise AgentStartError(f"agent not ready within {timeout_s} s:\n{self.log_text()}")

    def wait_exit(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """The exit code; subprocess.TimeoutExpired if it is still running after timeout_s."""
        return self.process.wait(timeout=timeout_s)

    def signal(self, signum: int) -> None:
        if self.alive:
            self.process.send_signal(signum)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then SIGKILL after timeout_s; always reaps. Returns the exit code."""
        try:
            if self.alive:
                self.process.send_signal(signal.SIGCONT)  # in case a test froze it
                self.process.terminate()
                try:
                    self.process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    self.process.kill()
            return self.process.wait(timeout=timeout_s)
        finally:
            _LIVE.discard(self.process)

    def kill(self) -> int:
        try:
            if self.alive:
                self.process.kill()
            return self.process.wait(timeout=STOP_TIMEOUT_S)
        finally:
            _LIVE.discard(self.process)


def start_agent(
    state_dir: Path,
    cluster_key: str,
    *,
    log_path: Path | None = None,
    interface: str = LOOPBACK,
    memory_limit: str | None = None,
    heartbeat_interval_s: float = 0.5,
    lost_after_s: float = 3.0,
    real_roles: bool = False,
    role_modules: Sequence[str] | None = None,
    extra_args: Sequence[str] = (),
    wait_ready: bool = True,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> AgentProcess:
    """Start `tandem join` bound to `interface`; by default wait for its ready line.

    By default tests/helpers/fake_role_worker.py stands in for both roles; real_roles=True runs the
    real workers, role_modules=["ROLE=MODULE", ...] others.
    """
    if role_modules is None:
        role_modules = () if real_roles else FAKE_WORKER_ROLES
    state_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_path or state_dir.with_suffix(".log")
    command = [
        sys.executable,
        "-m",
        "cli.main",
        "join",
        "--cluster-key",
        cluster_key,
        "--interface",
        interface,
        "--state-dir",
        str(state_dir),
        "--port",
        "0",
        "--heartbeat-interval",
        str(heartbeat_interval_s),
        "--lost-after",
        str(lost_after_s),
    ]
    for entry in role_modules:
        command += ["--role-module", entry]
    if memory_limit:
        command += ["--memory-limit", memory_limit]
    command += list(extra_args)
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=child_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    _LIVE.add(process)
    agent = AgentProcess(process, log_path, state_dir)
    if wait_ready:
        try:
            agent.wait_ready(ready_timeout_s)
        except BaseException:
            agent.stop()
            raise
    return agent


@dataclass
class AgentPool:
    """Agents started for one test; stop_all() in a fixture's teardown stops every one."""

    root: Path
    cluster_key: str = field(default_factory=new_key_text)
    agents: list[AgentProcess] = field(default_factory=list)

    def start(self, name: str, *, cluster_key: str | None = None, **options) -> AgentProcess:
        state_dir = options.pop("state_dir", None) or self.root / name
        agent = start_agent(
            state_dir,
            cluster_key or self.cluster_key,
            log_path=self.root / f"{name}-{len(self.agents)}.log",
            **options,
        )
        self.agents.append(agent)
        return agent

    def stop_all(self) -> None:
        """SIGTERM every agent at once (their shutdowns overlap), then reap or kill each."""
        for agent in self.agents:
            try:
                agent.signal(signal.SIGCONT)
                agent.signal(signal.SIGTERM)
            except OSError:
                pass
        for agent in self.agents:
            try:
                agent.stop()
            except Exception:  # noqa: BLE001 - keep stopping the others
                agent.kill()

    def logs(self) -> str:
        return "\n".join(f"--- {agent.log_path.name}\n{agent.log_text()}" for agent in self.agents)


def pid_exists(pid: int) -> bool:
    """Whether a process with this pid exists (a zombie counts as gone)."""
    stat_path = Path(f"/proc/{pid}/stat")
    if Path("/proc/self/stat").exists():
        try:
            return stat_path.read_text().rsplit(") ", 1)[-1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_until(predicate, timeout_s: float, interval_s: float = 0.1) -> bool:
    """Poll predicate until true or timeout_s passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


@atexit.register
def _kill_leftovers() -> None:
    for process in list(_LIVE):
        if process.poll() is None:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)
