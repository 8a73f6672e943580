"""The suite on several pytest-xdist workers (`make test`): a module, or a package with a
conftest of its own, runs whole on one worker (its fixtures start once), the costliest first;
each worker on a loopback of its own; tests that time the machine run with nothing beside them,
one after another on the worker that starts first (see SOLO_UNIT). Without xdist
(`pytest FILE`) only the solo marks are added."""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import prefetch

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
# Tests that start real processes; a guess of each kind's seconds orders the units.
PROCESS_MARKERS = ("lab", "cluster")
PROCESS_TEST_S, UNIT_TEST_S = 8.0, 0.2
# Tests that measure wall-clock speed or tight deadlines against the machine: they run alone
# (every other worker waits; ~110 s of the suite's wall time).
SOLO_MARKER = "solo"
# Solo tests from modules run together as one unit, handed out first: the other workers drain
# once for all of them instead of once each (ten drains cost ~100 s of idle workers). Those of
# a package unit (the lab's, the pipeline's: their fixtures start once per package) stay there.
SOLO_UNIT = "solo tests"
SOLO_TESTS = (
    # lab machines pinned to cores and quotas, timed against each other (the lab's other tests
    # check answers, memory and re-plans: they share the machine)
    "tests/lab/test_lab_speed_probe.py::test_the_probe_reads_a_cpu_quota",
    "tests/lab/test_lab_speed_probe.py::test_the_collective_probe_times",
    # speed probes: layer times and all_sums measured, a probe's child ready within 3 s, the
    # plan served within a margin of the fastest measured
    "tests/cluster/test_measured_planning.py::test_the_probe_measures_a_layer",
    "tests/cluster/test_measured_planning.py::test_serve_measures_its_agent",
    "tests/cluster/test_all_sum_probe.py::",
    # latency with strangers at every port within 1.5x of the latency without them, and
    # answers within 0.5 s
    "tests/cluster/test_strangers.py::",
    # four re-plan attempts, 0.15 s apart and doubling
    "tests/cluster/test_supervisor.py::test_failed_replans_back_off",
    # a weight fetch beside 72 strangers within 1 s + twice its time alone
    "tests/weights/test_weight_transfer.py::test_strangers_holding_the_weight_port",
    # a request with a 2 s timeout must get its first token amid a burst of eight
    "tests/pipeline/test_pipeline_batching.py::test_burst_of_eight",
    # /health within 0.5 s while the event loop's neighbour tokenizes a huge prompt
    "tests/api/test_api_errors.py::test_tokenizing_a_huge_prompt_does_not_stall_the_event_loop",
    # a queued request's 0.1 s deadline answered within 3 s (4.0 s seen in a slow suite run)
    "tests/api/test_api_errors.py::test_api_deadline_cancels_a_request_stuck_in_the_queue",
    # a 0.5 s ready timeout the fake worker's first progress must beat
    "tests/planner/test_transfer_planning.py::test_progress_extends_the_ready_wait",
    # a join during a re-plan planned in within the interval + 1 s (3.03 s seen beside others)
    "tests/cluster/test_late_joins.py::test_agents_joining_during_a_replan",
)
ISOLATED = pytest.StashKey[str]()  # "" when this worker has its own loopback, else why not
SOLO_HELD = pytest.StashKey[ExitStack]()  # the machine, held alone through a run of solo tests


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
        if not config.stash[ISOLATED]:
            prefetch.mark_offline()
    elif getattr(config.option, "numprocesses", None):
        # The controller, before any worker starts: the workers will have no network.
        for problem in prefetch.prefetch_all():
            print(f"prefetch: {problem}", file=sys.stderr)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(SOLO_TESTS):
            item.add_marker(SOLO_MARKER)
    if worker_id(config) is None:
        return
    # Every worker sorts alike (xdist checks), and the scheduler hands the units out in this
    # order: the costliest first, so that no long one ends the run alone on one worker.
    cost: dict[str, float] = {SOLO_UNIT: float("inf")}
    for item in items:
        unit = unit_of(item.nodeid, config.rootpath)
        heavy = any(map(item.get_closest_marker, PROCESS_MARKERS))
        cost[unit] = cost.get(unit, 0.0) + (PROCESS_TEST_S if heavy else UNIT_TEST_S)
    items.sort(key=lambda item: -cost[unit_of(item.nodeid, config.rootpath)])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadscope` with our units (xdist's loadgroup marks are lost on pytest 9.2)."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid, config.rootpath)

    return UnitScheduling(config, log)


def unit_of(nodeid: str, root: Path) -> str:
    """What one worker runs whole: a package with a conftest.py of its own (its package and
    session fixtures start once; named "dir/"), else the solo tests of modules, else a module
    (its module fixtures start once)."""
    module = Path(nodeid.split("::", 1)[0])
    package = module.parent
    if package.parent != Path() and (root / package / "conftest.py").is_file():
        return f"{package}/"
    if nodeid.startswith(SOLO_TESTS):
        return SOLO_UNIT
    return str(module)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Setup, call and teardown of one test under the run's machine lock (shared, or alone for a
    solo test) and, when this worker shares the host's loopback, the loopback lock. Solo tests
    that follow each other on a worker keep the machine to themselves in between: the others
    drain once for the run of them, not once each."""
    if worker_id(item.config) is None:
        return (yield)
    locks = Path(item.config.getoption("basetemp")).parent
    alone = is_solo(item)
    with ExitStack() as held:
        if item.config.stash[ISOLATED] and any(map(item.get_closest_marker, PROCESS_MARKERS)):
            held.enter_context(locked(locks / "loopback.lock", exclusive=True))
        kept = item.config.stash.get(SOLO_HELD, None)
        if kept is None:
            machine = ExitStack()
            # Through the gate: once a solo test waits there, no test starts before it.
            with locked(locks / "gate.lock", exclusive=True):
                machine.enter_context(locked(locks / "machine.lock", exclusive=alone))
            if alone:
                item.config.stash[SOLO_HELD] = kept = machine
            else:
                held.enter_context(machine)
        try:
            return (yield)
        finally:
            if kept is not None and not (nextitem is not None and is_solo(nextitem)):
                del item.config.stash[SOLO_HELD]
                kept.close()


def is_solo(item: pytest.Item) -> bool:
    return item.get_closest_marker(SOLO_MARKER) is not None


@contextmanager
def locked(path: Path, *, exclusive: bool) -> Iterator[None]:
    """flock on `path` for the block: shared among workers, or exclusive."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

