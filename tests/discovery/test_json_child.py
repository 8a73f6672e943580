"""JsonChild: spawn with a spec line, ready/failed/exit/silence, stderr tail, stop and kill."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator

import pytest

from discovery.json_child import ChildNotReady, JsonChild
from tests.helpers.cluster import REPO_ROOT, child_env
from tests.helpers.signals import wake

FAKE = [sys.executable, "-m", "tests.helpers.fake_role_worker"]
SILENT = [sys.executable, "-c", "import sys, time; sys.stdin.readline(); time.sleep(60)"]
# Prints a protocol line through the child-side helper, then a stray print() that must not
# reach the protocol stream, then echoes every command back.
ECHO = [
    sys.executable,
    "-c",
    "import json, sys\n"
    "from discovery.json_child import open_protocol_output\n"
    "out = open_protocol_output()\n"
    "spec = json.loads(sys.stdin.readline())\n"
    "print('a stray print')\n"
    "out.write({'event': 'ready', 'spec': spec})\n"
    "for line in sys.stdin:\n"
    "    out.write({'echo': json.loads(line)})\n",
]


@pytest.fixture
def children() -> Iterator[list[JsonChild]]:
    started: list[JsonChild] = []
    try:
        yield started
    finally:
        for child in started:
            if child.poll() is None:
                wake(child.pid)
            child.kill()


def spawn(children: list[JsonChild], command: list[str], spec: dict, **options) -> JsonChild:
    child = JsonChild(command, name="test child", env=child_env(), cwd=REPO_ROOT, **options)
    children.append(child)
    child.start(spec)
    return child


def test_ready_then_commands_both_ways_and_stray_prints_stay_off_the_protocol(children):
    lines: list[str] = []
    child = spawn(children, ECHO, {"key": "value"}, on_stderr=lines.append)
    assert child.wait_ready(30) == {"event": "ready", "spec": {"key": "value"}}
    child.send({"cmd": 1})
    assert child.next_message(10) == {"echo": {"cmd": 1}}
    assert child.stop(5, ask=child.close_stdin) == 0  # EOF on stdin: it exits by itself
    assert "a stray print" in lines
    assert child.next_message(1) is None  # the exit is queued after the last message


def test_a_failed_line_gives_its_reason_even_past_a_broken_callback(children):
    def broken(message: dict) -> None:
        raise RuntimeError("a callback's bug")  # must not stop the reader

    child = spawn(children, FAKE, {"mode": "fail", "tag": "t1"}, on_message=broken)
    with pytest.raises(ChildNotReady, match="fake failure for t1") as raised:
        child.wait_ready(10)
    assert not raised.value.timed_out


def test_an_exit_before_ready_names_the_code_and_the_last_log_line(children):
    codes: list[int] = []
    child = spawn(children, FAKE, {"mode": "crash"}, on_exit=codes.append)
    with pytest.raises(ChildNotReady, match=r"exited \(code 3\).*crashed on purpose"):
        child.wait_ready(30)
    assert codes == [3]


def test_silence_times_out_and_stop_kills_what_ignores_sigterm(children):
    child = spawn(children, SILENT, {})
    with pytest.raises(ChildNotReady, match="no ready line within 0.5 s") as raised:
        child.wait_ready(0.5)
    assert raised.value.timed_out
    stubborn = spawn(children, FAKE, {"mode": "stubborn"}, own_group=True)
    stubborn.wait_ready(30)
    started = time.monotonic()
    assert stubborn.stop(0.5) == -signal.SIGKILL
    assert time.monotonic() - started < 4


def test_a_stopped_process_is_seen_as_stopped(children):
    child = spawn(children, FAKE, {"mode": "ready"})
    child.wait_ready(30)
    assert not child.is_stopped()
    os.kill(child.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while not child.is_stopped() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.is_stopped()
    child.kill()  # SIGKILL reaches a stopped process
    assert child.poll() == -signal.SIGKILL and not child.is_stopped()
