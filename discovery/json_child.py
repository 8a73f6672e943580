"""A child process that speaks JSON lines: the parent's JsonChild and the child's protocol output.

The protocol every tandem worker follows (tp ranks, pp stages, the agent's role workers):
stdin:  line 1 is a JSON spec (so keys never reach argv or the environment); then, for
        workers that take commands, one JSON object per line. stdin stays open while the
        parent lives, so a child can treat EOF as "my parent is gone".
stdout: JSON objects only, one per line: {"event": "ready", ...} or {"event": "failed",
        "reason": ...} once loaded, then whatever the worker answers. Before that, a child may
        say it is still on its way: {"event": "progress", ...} (a model arriving) or
        {"event": "started"} (up, its spec read, now doing its work).
stderr: the child's log; the parent echoes it and keeps a short tail for error messages.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import psutil

from errors import TandemError

log = logging.getLogger(__name__)

STDERR_TAIL_LINES = 20
KILL_GRACE_S = 2.0  # SIGKILL cannot be refused: this only bounds a stuck kernel
READER_JOIN_S = 2.0
STOPPED_STATES = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)

Message = dict[str, Any]
ON_ITS_WAY = ("progress", "started")  # events before ready that only restart a wait


class ChildNotReady(TandemError):
    """A child did not report ready: it failed, exited, or stayed silent past the timeout."""

    def __init__(self, reason: str, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.timed_out = timed_out


class JsonChild:
    """One child process speaking JSON lines (see the module docstring), read on two threads.

    Every stdout message goes to `on_message` (from the reader thread) and, with
    `keep_messages`, to a queue for next_message() and wait_ready(). `on_stderr` sees each log
    line; `on_exit(code)` runs once stdout has closed and the process is reaped, then the queue
    gets None. `own_group` starts the child in its own process group, so stopping it reaches
    its children too. `stderr` other than PIPE (a file, None to inherit) is passed through.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        name: str,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
        stderr: Any = subprocess.PIPE,
        own_group: bool = False,
        keep_messages: bool = True,
        on_message: Callable[[Message], None] | None = None,
        on_stderr: Callable[[str], None] | None = None,
        on_exit: Callable[[int], None] | None = None,
        pass_fds: Sequence[int] = (),
    ) -> None:
        self.command = list(command)
        self._pass_fds = tuple(pass_fds)  # descriptors the child inherits (a listening socket)
        self.name = name
        self.process: subprocess.Popen[bytes] | None = None
        self._env = dict(env) if env is not None else None
        self._cwd = cwd
        self._stderr = stderr
        self._own_group = own_group
        self._keep_messages = keep_messages
        self._on_message = on_message
        self._on_stderr = on_stderr
        self._on_exit = on_exit
        self._messages: queue.Queue[Message | None] = queue.Queue()
        self._stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self._write_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def poll(self) -> int | None:
        """The exit code, or None while it runs (or before start)."""
        return self.process.poll() if self.process is not None else None

    # -- starting and talking --------------------------------------------------------------------

    def start(self, spec: Message | None) -> None:
        """Spawn the child and hand it `spec` as its first line (None: send() it later, once
        the child has done what it does before reading it); OSError if it cannot spawn.

        A child that dies before reading its spec is reported like any exit (on_exit, None
        in the queue), so callers have one failure path.
        """
        self.process = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=self._env,
            cwd=self._cwd,
            start_new_session=self._own_group,
            pass_fds=self._pass_fds,
        )
        log.info("started %s (pid %d)", self.name, self.process.pid)
        stderr_reader = None
        if self.process.stderr is not None:
            stderr_reader = threading.Thread(
                target=self._read_stderr, name=f"{self.name} stderr", daemon=True
            )
        stdout_reader = threading.Thread(
            target=self._read_stdout, args=(stderr_reader,), name=f"{self.name} stdout", daemon=True
        )
        self._threads = [thread for thread in (stderr_reader, stdout_reader) if thread]
        for thread in self._threads:
            thread.start()
        if spec is None:
            return
        try:
            self.send(spec)
        except (OSError, ValueError) as error:
            log.warning("could not hand the spec to %s (pid %d): %s", self.name, self.pid, error)

    def send(self, message: Message) -> None:
        """Write one JSON line to the child's stdin; OSError or ValueError once it is gone."""
        if self.process is None or self.process.stdin is None:
            raise ValueError(f"{self.name} is not started")
        data = self._encode(message)
        with self._write_lock:
            self.process.stdin.write(data)
            self.process.stdin.flush()

    def next_message(self, timeout_s: float | None) -> Message | None:
        """The next stdout message; None once the child exited (or wake() was called);
        TimeoutError when none came within `timeout_s`."""
        try:
            return self._messages.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no message from {self.name} within {timeout_s:g} s") from None

    def wake(self) -> None:
        """Make a caller waiting in next_message() return None now (an abort, a lost peer)."""
        self._messages.put(None)

    def wait_ready(self, timeout_s: float) -> Message:
        """The child's ready message; ChildNotReady (with the reason) when it failed, exited
        or said nothing in time (progress and started lines are skipped, each restarting the
        wait). The caller decides whether to kill it."""
        message: Message | None = {"event": "progress"}
        while message is not None and message.get("event") in ON_ITS_WAY:
            try:
                message = self.next_message(timeout_s)
            except TimeoutError:
                reason = f"no ready line within {timeout_s:g} s; last log: {self.last_log()}"
                raise ChildNotReady(reason, timed_out=True) from None
        if message is None:
            raise ChildNotReady(f"it {self.exit_description()}")
        if message.get("event") != "ready":
            raise ChildNotReady(str(message.get("reason", message)))
        return message

    # -- what it looks like ----------------------------------------------------------------------

    def last_log(self) -> str:
        """The child's last stderr line, for error messages."""
        return self._stderr_tail[-1] if self._stderr_tail else "(none)"

    def exit_description(self) -> str:
        """'exited (code N); last log: ...', waiting briefly for the exit code."""
        code = None
        if self.process is not None:
            try:
                code = self.process.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        return f"exited (code {code}); last log: {self.last_log()}"

    def is_stopped(self) -> bool:
        """Whether its process is stopped (SIGSTOP, a debugger): it breaks no socket, its
        peers just wait. False when it runs or is gone."""
        if self.process is None or self.process.poll() is not None:
            return False
        try:
            return psutil.Process(self.process.pid).status() in STOPPED_STATES
        except psutil.Error:
            return False

    # -- stopping --------------------------------------------------------------------------------

    def stop(self, grace_s: float, ask: Callable[[], None] | None = None) -> int | None:
        """Ask it to exit (`ask`, by default SIGTERM), SIGKILL it after `grace_s`, close its
        stdin and join the readers; the exit code. Idempotent."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            try:
                (ask or self.terminate)()
                process.wait(timeout=grace_s)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                log.warning(
                    "%s (pid %d) did not exit within %g s; killing it", self.name, self.pid, grace_s
                )
        self.kill()
        self.join_readers()
        return process.poll()

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL it now (any thread) and close its stdin; does not join the readers."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            self._signal(signal.SIGKILL)
        try:
            process.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) did not exit after SIGKILL", self.name, process.pid)
        self.close_stdin()

    def close_stdin(self) -> None:
        """EOF on its stdin: a worker takes it as "the parent is gone" and exits."""
        if self.process is not None and self.process.stdin is not None:
            try:
                self.process.stdin.close()
            except OSError:
                pass

    def join_readers(self, timeout_s: float = READER_JOIN_S) -> None:
        for thread in self._threads:
            if thread is not threading.current_thread():  # a callback may stop its own child
                thread.join(timeout_s)

    def _signal(self, signum: int) -> None:
        assert self.process is not None
        try:
            if self._own_group:
                os.killpg(self.process.pid, signum)  # the group id is the pid: own session
            else:
                self.process.send_signal(signum)
        except ProcessLookupError:
            pass
        except PermissionError:
            self.process.send_signal(signum)

    # -- the reader threads ----------------------------------------------------------------------

    def _read_stderr(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        for raw in self.process.stderr:
            line = raw.decode(errors="replace").rstrip()
            if not line:
                continue
            self._stderr_tail.append(line)
            log.info("%s %d | %s", self.name, self.process.pid, line)
            if self._on_stderr is not None:
                self._call(self._on_stderr, line)

    # -- the encoding: JSON lines here; engines/core/core_process.py's child uses msgpack ------

    def _encode(self, message: Message) -> bytes:
        return (json.dumps(message, separators=(",", ":")) + "\n").encode()

    def _decode(self, stream: IO[bytes]) -> Iterator[Any]:
        """Every message the child writes, until its stdout closes."""
        for raw in stream:
            try:
                yield json.loads(raw)
            except ValueError:
                log.warning("%s wrote a line that is not JSON: %r", self.name, raw[:200])

    def _read_stdout(self, stderr_reader: threading.Thread | None) -> None:
        assert self.process is not None and self.process.stdout is not None
        for message in self._decode(self.process.stdout):
            if not isinstance(message, dict):
                continue
            if self._on_message is not None:
                self._call(self._on_message, message)
            if self._keep_messages:
                self._messages.put(message)
        code = self.process.wait()
        if stderr_reader is not None:
            stderr_reader.join(READER_JOIN_S)  # so on_exit sees the whole stderr tail
        if self._on_exit is not None:
            self._call(self._on_exit, code)
        self._messages.put(None)

    def _call(self, callback: Callable[..., None], *arguments: Any) -> None:
        # A callback's bug must not end the reader: the exit would never reach next_message().
        try:
            callback(*arguments)
        except Exception:
            log.exception("%s: a callback failed", self.name)


class ProtocolOutput:
    """The child's side of stdout: one JSON object per line, written whole under a lock."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def write(self, message: Message) -> None:
        line = json.dumps(message, separators=(",", ":")) + "\n"
        with self._lock:
            self._stream.write(line)
            self._stream.flush()


def configure_child_logging(label: str, level: int | str = logging.INFO) -> None:
    """In the child: log to stderr (the parent keeps its tail for error messages), each line
    tagged with `label` (e.g. "stage[%(process)d]" or "rank1")."""
    logging.basicConfig(
        stream=sys.stderr,
        level=level,
        format=f"%(asctime)s {label} %(levelname)s %(name)s: %(message)s",
    )


def open_protocol_output() -> ProtocolOutput:
    """In the child: keep fd 1 for protocol lines and send anything else printed (Python or
    C++, e.g. a library's warning) to stderr, so it cannot corrupt the protocol."""
    protocol_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return ProtocolOutput(os.fdopen(protocol_fd, "w", encoding="utf-8"))


def run_measuring_role(
    name: str, key: str, measure: Callable[[dict[str, Any]], dict[str, Any]]
) -> int:
    """A role that measures once, in the child: its JSON spec on stdin, one ready line with
    `measure(spec)` under `key` (or a failed line naming `name`), then it stays until released,
    as every role does (the agent reads an early exit as a failure)."""
    configure_child_logging(f"{name.replace(' ', '-')}[%(process)d]")
    output = open_protocol_output()
    try:
        spec = json.loads(sys.stdin.buffer.readline() or b"null")
        output.write({"event": "started"})  # its imports are done: the measuring begins
        result = measure(spec)
    except (TypeError, KeyError, ValueError, AttributeError, RuntimeError) as error:
        output.write({"event": "failed", "reason": f"{name} failed: {error}"})
        return 1
    output.write({"event": "ready", key: result})
    sys.stdin.buffer.read()
    return 0
