"""Capability probes: memory, memory limits, platform, JACCL/RDMA detection."""

from __future__ import annotations

import sys

import pytest

from discovery.capabilities import (
    BACKEND_JACCL,
    BACKEND_RING,
    RdmaDevice,
    apply_memory_limit,
    check_jaccl,
    format_memory_size,
    parse_ibv_devinfo,
    parse_meminfo,
    parse_memory_size,
    parse_vm_stat,
    probe_capabilities,
    read_memory,
    run_probe,
)
from errors import ConfigError

MIB = 1024**2
GIB = 1024**3

MEMINFO = """MemTotal:       16384000 kB
MemFree:         1000000 kB
MemAvailable:    8192000 kB
Cached:          2000000 kB
"""
OLD_MEMINFO = """MemTotal:       1000 kB
MemFree:         100 kB
Cached:          200 kB
"""
VM_STAT = """Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               10000.
Pages active:                            500000.
Pages inactive:                           20000.
Pages speculative:                         3000.
Pages purgeable:                           1000.
"""
# As TN3205 shows it for a Mac with three Thunderbolt 5 ports, one cabled.
IBV_DEVINFO = """hca_id: rdma_en2
        transport:                      Thunderbolt (100)
        phys_port_cnt:                  1
                port:   1
                        state:                  PORT_DOWN (1)
hca_id: rdma_en3
        transport:                      Thunderbolt (100)
                port:   1
                        state:                  PORT_ACTIVE (4)
hca_id: rdma_en4
        transport:                      Thunderbolt (100)
"""


def test_memory_numbers_are_positive() -> None:
    total, available = read_memory()
    assert total > 0
    assert 0 < available <= total


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512M", 512 * MIB),
        ("2G", 2 * GIB),
        ("2g", 2 * GIB),
        ("1.5G", int(1.5 * GIB)),
        ("2GiB", 2 * GIB),
        ("2GB", 2 * GIB),
        ("64k", 64 * 1024),
        ("1T", 1024 * GIB),
        ("1048576", 1048576),
        (" 8G ", 8 * GIB),
    ],
)
def test_parse_memory_size(text: str, expected: int) -> None:
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1G", "0", "0M", "2X", "1e9", "G", "2 G B", "1,5G"])
def test_parse_memory_size_rejects_bad_values(text: str) -> None:
    with pytest.raises(ConfigError, match="memory size"):
        parse_memory_size(text)


def test_format_memory_size() -> None:
    assert format_memory_size(512 * MIB) == "512.0M"
    assert format_memory_size(int(1.5 * GIB)) == "1.5G"
    assert format_memory_size(100) == "100B"


@pytest.mark.parametrize(
    ("limit", "expected"),
    [(None, (8 * GIB, 6 * GIB)), (4 * GIB, (4 * GIB, 4 * GIB)), (7 * GIB, (7 * GIB, 6 * GIB))],
)
def test_memory_limit_caps_total_and_available(limit: int | None, expected: tuple) -> None:
    assert apply_memory_limit(8 * GIB, 6 * GIB, limit) == expected


def test_probe_reports_the_memory_limit() -> None:
    capabilities = probe_capabilities(memory_limit=512 * MIB)
    assert 0 < capabilities.memory_available <= 512 * MIB
    assert 0 < capabilities.memory_total <= 512 * MIB


def test_probe_backends_always_include_ring() -> None:
    capabilities = probe_capabilities()
    assert BACKEND_RING in capabilities.backends
    assert capabilities.platform
    assert capabilities.memory_total > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_jaccl_is_absent_on_linux() -> None:
    capabilities = probe_capabilities()
    assert BACKEND_JACCL not in capabilities.backends
    assert capabilities.macos_version is None
    assert "macOS" in capabilities.jaccl_reason


def test_parse_meminfo() -> None:
    assert parse_meminfo(MEMINFO) == (16384000 * 1024, 8192000 * 1024)
    assert parse_meminfo(OLD_MEMINFO) == (1000 * 1024, 300 * 1024)


def test_parse_vm_stat_counts_reclaimable_pages() -> None:
    assert parse_vm_stat(VM_STAT) == (10000 + 20000 + 3000 + 1000) * 16384


def test_parse_ibv_devinfo() -> None:
    assert parse_ibv_devinfo(IBV_DEVINFO) == (
        RdmaDevice("rdma_en2", "PORT_DOWN"),
        RdmaDevice("rdma_en3", "PORT_ACTIVE"),
        RdmaDevice("rdma_en4", "UNKNOWN"),
    )
    assert parse_ibv_devinfo("") == ()


ACTIVE = (RdmaDevice("rdma_en3", "PORT_ACTIVE"),)
DOWN = (RdmaDevice("rdma_en3", "PORT_DOWN"),)


@pytest.mark.parametrize(
    ("macos", "status", "devices", "reason_part"),
    [
        (None, None, ACTIVE, "needs macOS"),
        ("15.6", "enabled", ACTIVE, "macOS >= 26.2, this is 15.6"),
        ("26.1", "enabled", ACTIVE, "this is 26.1"),
        ("26.2", None, ACTIVE, "did not answer"),
        ("26.2", "disabled\n", ACTIVE, "rdma_ctl enable"),
        ("26.2", "enabled\n", DOWN, "no RDMA device has an active port"),
        ("26.2", "enabled\n", (), "no RDMA device has an active port"),
        ("26.2", "enabled\n", ACTIVE, ""),
        ("27.0.1", "enabled", DOWN + ACTIVE, ""),
    ],
)
def test_check_jaccl(
    macos: str | None, status: str | None, devices: tuple, reason_part: str
) -> None:
    reason = check_jaccl(macos, status, devices)
    if reason_part:
        assert reason_part in reason
    else:
        assert reason == ""


def test_probes_never_raise() -> None:
    assert run_probe(["tandem-no-such-probe-command"]) is None
    assert run_probe([sys.executable, "-c", "import time; time.sleep(5)"], timeout_s=0.3) is None
    assert run_probe([sys.executable, "-c", "raise SystemExit(2)"]) is None
    assert run_probe([sys.executable, "-c", "print('enabled')"]) == "enabled\n"
