"""The memory tier rule (table-driven) and the monitor that samples this machine with psutil."""

from __future__ import annotations

import logging

import psutil
import pytest

from discovery.control import Heartbeat, MemoryReport, decode, encode
from discovery.memory_monitor import MemoryMonitor, apply_budget, take_sample
from discovery.memory_tiers import (
    CRITICAL,
    OK,
    WARN,
    Thresholds,
    classify,
    thresholds_for,
    worst_tier,
)

MIB = 1024**2
GIB = 1024**3


@pytest.mark.parametrize(
    ("total", "warn", "critical"),
    [
        # small or budget-capped nodes: the floors shrink to a share of the node
        (64 * MIB, 16 * MIB, int(6.4 * MIB)),
        (256 * MIB, 64 * MIB, int(25.6 * MIB)),
        (2 * GIB, 512 * MIB, int(204.8 * MIB)),
        (4 * GIB, 1 * GIB, int(409.6 * MIB)),
        # laptops: the absolute floors (1 GiB, 512 MiB) win over the fractions
        (8 * GIB, 1 * GIB, 512 * MIB),
        # the fractions (10%, 4%)
        (16 * GIB, int(1.6 * GIB), int(0.64 * GIB)),
        (64 * GIB, int(6.4 * GIB), int(2.56 * GIB)),
        (128 * GIB, int(12.8 * GIB), int(5.12 * GIB)),
        # large machines: the ceilings (16 GiB, 6 GiB)
        (192 * GIB, 16 * GIB, 6 * GIB),
        (512 * GIB, 16 * GIB, 6 * GIB),
    ],
)
def test_thresholds_scale_with_the_node(total: int, warn: int, critical: int) -> None:
    assert thresholds_for(total) == Thresholds(warn=warn, critical=critical)


@pytest.mark.parametrize(
    ("available", "previous", "expected"),
    [
        # 8 GiB node: warn below 1 GiB, critical below 512 MiB; leave at 1.25 GiB / 640 MiB
        (4 * GIB, OK, OK),
        (1 * GIB, OK, OK),  # exactly at the threshold is still ok
        (1 * GIB - 1, OK, WARN),
        (600 * MIB, OK, WARN),
        (511 * MIB, OK, CRITICAL),
        (0, WARN, CRITICAL),
        (600 * MIB, CRITICAL, CRITICAL),  # above critical but inside the recovery margin
        (640 * MIB, CRITICAL, WARN),
        (1.2 * GIB, WARN, WARN),  # above warn but inside the recovery margin
        (1.2 * GIB, CRITICAL, WARN),
        (1.25 * GIB, WARN, OK),
        (1.25 * GIB, CRITICAL, OK),
        (1.2 * GIB, OK, OK),  # the margin only holds a node that was in the tier
    ],
)
def test_classify_with_hysteresis(available: float, previous: str, expected: str) -> None:
    assert classify(int(available), 8 * GIB, previous) == expected


@pytest.mark.parametrize(
    ("tiers", "expected"),
    [((), OK), ((OK, OK), OK), ((OK, WARN), WARN), ((CRITICAL, WARN, OK), CRITICAL)],
)
def test_worst_tier(tiers: tuple[str, ...], expected: str) -> None:
    assert worst_tier(tiers) == expected


@pytest.mark.parametrize(
    ("machine", "tandem", "budget", "expected"),
    [
        ((16 * GIB, 10 * GIB), 2 * GIB, None, (16 * GIB, 10 * GIB)),  # no budget: the machine
        ((16 * GIB, 10 * GIB), 2 * GIB, 4 * GIB, (4 * GIB, 2 * GIB)),  # tandem counts against it
        ((16 * GIB, 1 * GIB), 2 * GIB, 8 * GIB, (8 * GIB, 1 * GIB)),  # the machine is lower still
        ((16 * GIB, 10 * GIB), 5 * GIB, 4 * GIB, (4 * GIB, 0)),  # over budget: nothing left
        ((4 * GIB, 3 * GIB), 0, 8 * GIB, (4 * GIB, 3 * GIB)),  # a budget above the machine
    ],
)
def test_apply_budget(
    machine: tuple[int, int], tandem: int, budget: int | None, expected: tuple[int, int]
) -> None:
    assert apply_budget(*machine, tandem, budget) == expected


def test_a_sample_reads_this_machine_and_this_process() -> None:
    process = psutil.Process()
    sample = take_sample(process)
    assert sample.total == psutil.virtual_memory().total
    assert 0 < sample.available <= sample.total
    assert sample.tandem_bytes >= process.memory_info().rss // 2  # this python, at least
    assert sample.budget is None
    assert sample.tier == classify(sample.available, sample.total)


def test_a_budget_smaller_than_this_process_is_critical_and_a_large_one_is_ok() -> None:
    rss = psutil.Process().memory_info().rss
    tiny = MemoryMonitor(budget=rss // 2).latest()
    assert (tiny.total, tiny.available, tiny.tier) == (rss // 2, 0, CRITICAL)
    roomy = MemoryMonitor(budget=rss + 2 * GIB).latest()
    machine = psutil.virtual_memory()
    assert roomy.total == min(machine.total, rss + 2 * GIB)
    # about 2 GiB left under the budget: ok, unless the machine itself is that low
    assert roomy.available > GIB or machine.available < 2 * GIB
    assert roomy.tier == classify(roomy.available, roomy.total)


def test_the_monitor_logs_each_tier_change_once(caplog: pytest.LogCaptureFixture) -> None:
    rss = psutil.Process().memory_info().rss
    monitor = MemoryMonitor(budget=rss + 8 * GIB, label="node-x")
    caplog.set_level(logging.INFO, logger="discovery.memory_monitor")
    monitor.budget = rss // 2  # the operator's budget shrinks under the node: critical
    assert [monitor.sample_now().tier for _ in range(3)] == [CRITICAL] * 3
    monitor.budget = rss + 8 * GIB
    assert [monitor.sample_now().tier for _ in range(3)] == [OK] * 3
    changes = [record for record in caplog.records if "node-x" in record.getMessage()]
    assert [(record.levelno, record.getMessage().split(":")[1]) for record in changes] == [
        (logging.WARNING, " ok -> critical"),
        (logging.INFO, " critical -> ok"),
    ]


def test_the_background_thread_keeps_sampling() -> None:
    monitor = MemoryMonitor(interval_s=0.05).start()
    try:
        first = monitor.latest()
        deadline = 100
        while monitor.latest() is first and deadline:
            deadline -= 1
            monitor._stopping.wait(0.05)
        assert monitor.latest() is not first
    finally:
        monitor.stop()
    assert not monitor._thread.is_alive()


def test_heartbeats_carry_the_memory_report_over_the_wire() -> None:
    report = MemoryReport(total=GIB, available=MIB, tandem_bytes=GIB - MIB, tier="critical")
    heartbeat = Heartbeat(node_id="n", state="idle", memory_available=0, sent_at=1.0, memory=report)
    assert decode(encode(heartbeat)) == heartbeat
    legacy = Heartbeat(node_id="n", state="idle", memory_available=0, sent_at=1.0)
    assert decode(encode(legacy)).memory is None
    with pytest.raises(Exception, match="tier"):
        decode(encode(heartbeat).replace(b'"critical"', b'"panic"'))


@pytest.mark.parametrize("command", ["serve", "join"])
def test_memory_budget_flag_and_its_environment_twin(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cli import join, serve
    from cli.main import build_parser

    module = {"serve": serve, "join": join}[command]
    key = ["--cluster-key", "tandem-" + "A" * 43]
    args = build_parser().parse_args([command, *key, "--memory-budget", "2GiB"])
    assert module.config_from_args(args).memory_budget == 2 * GIB
    monkeypatch.setenv("TANDEM_MEMORY_BUDGET", "512M")
    args = build_parser().parse_args([command, *key])
    assert module.config_from_args(args).memory_budget == 512 * MIB
    monkeypatch.delenv("TANDEM_MEMORY_BUDGET")
    assert module.config_from_args(build_parser().parse_args([command, *key])).memory_budget is None
