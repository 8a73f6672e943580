"""`tandem serve` takes its HTTP port first: a port in use fails the serve at once in one line
naming who holds it, and once taken no other socket (an internal server) can bind that number."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time

import pytest

from cli.public_address import bind_public_address
from errors import ConfigError
from tests.helpers.api import ROOT


def test_a_port_in_use_fails_the_serve_at_once_naming_its_holder() -> None:
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    started = time.monotonic()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "cli.main", "serve", "--model", "demo", "--port", str(port)],
            cwd=ROOT,
            env={**os.environ, "TANDEM_INTERFACE": "127.0.0.1"},
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        holder.close()
    took = time.monotonic() - started
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"tandem: error: cannot serve on 127.0.0.1:{port}: the address")
    assert f"in use by PID {os.getpid()} (" in lines[0] and lines[0].endswith("another --port")
    assert took < 5, f"{took:.1f} s: the port must be taken before anything loads"


def test_once_taken_the_port_number_cannot_be_bound_by_anything_else() -> None:
    """An internal server's bind of that number fails, SO_REUSEADDR or not; a client that
    connects while the model loads is held, not refused."""
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    listener = bind_public_address("127.0.0.1", port)
    try:
        other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError) as refused:
            other.bind(("127.0.0.1", port))
        assert refused.value.errno == errno.EADDRINUSE
        other.close()
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # in the backlog
    finally:
        listener.close()


def test_an_address_that_cannot_be_bound_is_one_line() -> None:
    with pytest.raises(ConfigError) as refused:
        bind_public_address("198.51.100.7", 8000)  # TEST-NET-2: no interface has it
    assert str(refused.value).startswith("cannot serve on 198.51.100.7:8000: ")
    assert "\n" not in str(refused.value)
