"""The suite on several pytest-xdist workers (`make test`): each worker on a loopback of its own,
the modules that start real processes handed out first, and tests that time the machine run
with nothing else beside them. Without xdist (`pytest FILE`) none of this does anything."""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
# Real processes: started first, so the long ones do not end the run alone on one worker.
PROCESS_MARKERS = ("lab", "cluster")
# Tests that measure wall-clock speed or tight deadlines against the machine: they run alone
# (every other worker waits). Lab tests are among them by their marker.
SOLO_MARKER = "solo"
SOLO_TESTS = (
    # speed probes compare a held machine's layer time with a free one's
    "tests/cluster/test_measured_planning.py::",
    "tests/cluster/test_all_sum_probe.py::",
    # a 0.5 s ready timeout the fake worker's first progress must beat
    "tests/planner/test_transfer_planning.py::test_progress_extends_the_ready_wait",
)
ISOLATED = pytest.StashKey[str]()  # "" when this worker has its own loopback, else why not


def worker_id(config: pytest.Config) -> str | None:
    """This process's xdist worker id ("gw0", ...), or None outside a worker."""
    workerinput = getattr(config, "workerinput", None)
    return workerinput["workerid"] if workerinput else None


def isolate_loopback() -> str:
    """Put this process (and every process it starts from now on) in a network namespace of
    its own with only a loopback, up: agents' zeroconf, ports and pipelines of one worker never
    meet another's. '' on success, else why not (not root, no namespaces)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        return f"unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())}"
    # A new namespace's loopback is down; nothing here has bound a socket yet.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(probe, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(probe, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
    return ""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{SOLO_MARKER}: runs with no other test beside it")
    if worker_id(config) is not None:
        config.stash[ISOLATED] = isolate_loopback()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("lab") or item.nodeid.startswith(SOLO_TESTS):
            item.add_marker(SOLO_MARKER)
    if worker_id(config) is None:
        return
    # Every worker sorts alike (xdist checks): modules with real processes first, in file order.
    first = {
        module_of(item) for item in items if any(map(item.get_closest_marker, PROCESS_MARKERS))
    }
    items.sort(key=lambda item: module_of(item) not in first)


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Setup, call and teardown of one test under the run's machine lock (shared, or alone for a
    solo test) and, when this worker shares the host's loopback, the loopback lock."""
    if worker_id(item.config) is None:
        return (yield)
    locks = Path(item.config.getoption("basetemp")).parent
    alone = item.get_closest_marker(SOLO_MARKER) is not None
    with ExitStack() as held:
        if item.config.stash[ISOLATED] and any(map(item.get_closest_marker, PROCESS_MARKERS)):
            held.enter_context(locked(locks / "loopback.lock", exclusive=True))
        # Through the gate: once a solo test waits there, no test starts before it.
        with locked(locks / "gate.lock", exclusive=True):
            held.enter_context(locked(locks / "machine.lock", exclusive=alone))
        return (yield)


@contextmanager
def locked(path: Path, *, exclusive: bool) -> Iterator[None]:
    """flock on `path` for the block: shared among workers, or exclusive."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
