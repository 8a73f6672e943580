"""MemoryMonitor: sample this node's memory in the background and keep its tier (psutil)."""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from discovery.capabilities import format_memory_size
from discovery.cgroup_memory import read_cgroup_memory
from discovery.memory_tiers import OK, classify, severity, thresholds_for

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0
JOIN_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class MemorySample:
    """One reading: the memory tandem considers this node to have, and its tier.

    `total` and `available` are the machine's, or under a budget min(machine total, budget)
    and min(machine available, budget - tandem_bytes): the budget is a smaller machine whose
    only tenant is tandem, while the real machine running low still counts.
    """

    total: int
    available: int
    tandem_bytes: int  # resident memory of this process and its children (workers, ranks)
    tier: str
    budget: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        limits = thresholds_for(self.total)
        budget = f", budget {format_memory_size(self.budget)}" if self.budget else ""
        size = format_memory_size
        return (
            f"{size(self.available)} of {size(self.total)} available, tandem holds "
            f"{size(self.tandem_bytes)}{budget} (warn below {size(limits.warn)}, critical below "
            f"{size(limits.critical)})"
        )


def read_tandem_bytes(process: psutil.Process) -> int:
    """Resident bytes of `process` and all its descendants; ones that just exited count 0."""
    total = 0
    try:
        family = [process, *process.children(recursive=True)]
    except psutil.Error:
        return 0
    for member in family:
        try:
            total += member.memory_info().rss
        except psutil.Error:
            continue
    return total


def apply_budget(
    total: int, available: int, tandem_bytes: int, budget: int | None
) -> tuple[int, int]:
    """(total, available) as tandem considers them under `budget` (None: the machine's)."""
    if budget is None:
        return total, available
    return min(total, budget), max(0, min(available, budget - tandem_bytes))


def take_sample(
    process: psutil.Process, budget: int | None = None, previous_tier: str = OK
) -> MemorySample:
    """Read the machine (within its cgroup limit) and tandem's own footprint now, and classify."""
    machine = psutil.virtual_memory()
    total, available = machine.total, machine.available
    cgroup = read_cgroup_memory()
    if cgroup is not None and cgroup.limit < total:  # a container: its limit is the machine
        total, available = cgroup.limit, min(available, cgroup.available)
    tandem_bytes = read_tandem_bytes(process)
    total, available = apply_budget(total, available, tandem_bytes, budget)
    return MemorySample(
        total=total,
        available=available,
        tandem_bytes=tandem_bytes,
        tier=classify(available, total, previous_tier),
        budget=budget,
    )


class MemoryMonitor:
    """Samples every `interval_s` on a daemon thread; logs each tier change once."""

    def __init__(
        self,
        budget: int | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        label: str = "this node",
        log_changes: bool = True,  # off where another component logs this node's tier
    ) -> None:
        if budget is not None and budget <= 0:
            raise ValueError(f"a memory budget must be positive, got {budget}")
        self.budget = budget
        self.interval_s = interval_s
        self.label = label
        self.log_changes = log_changes
        self._process = psutil.Process()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._sample = take_sample(self._process, budget)  # latest() answers from the start
        if self._sample.tier != OK and log_changes:
            sample = self._sample
            logger.warning("memory on %s is %s: %s", label, sample.tier, sample.describe())

    def start(self) -> MemoryMonitor:
        self._thread = threading.Thread(target=self._run, name="memory-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(JOIN_TIMEOUT_S)

    def latest(self) -> MemorySample:
        with self._lock:
            return self._sample

    def sample_now(self) -> MemorySample:
        """Take a sample at once (also what the thread does every interval)."""
        with self._lock:
            previous = self._sample
        sample = take_sample(self._process, self.budget, previous.tier)
        with self._lock:
            self._sample = sample
        if sample.tier != previous.tier and self.log_changes:
            self._log_change(previous.tier, sample)
        return sample

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            try:
                self.sample_now()
            except psutil.Error as error:  # keep the last sample; try again next interval
                logger.debug("memory sample failed: %s", error)

    def _log_change(self, previous: str, sample: MemorySample) -> None:
        level = logging.WARNING if severity(sample.tier) > severity(previous) else logging.INFO
        logger.log(
            level,
            "memory on %s: %s -> %s: %s",
            self.label,
            previous,
            sample.tier,
            sample.describe(),
        )
