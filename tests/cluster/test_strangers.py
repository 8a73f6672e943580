"""Strangers on the LAN cannot stall a running cluster: silent, trickling and unproven
connections held open against every listening port while streams decode."""

from __future__ import annotations

import os
import socket
import statistics
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.cluster import AgentPool
from tests.helpers.serve import ServeProcess, start_serve
from tests.helpers.strangers import Strangers, stream_all

pytestmark = pytest.mark.cluster

PER_KIND = 12  # silent, trickling and unproven-hello connections per port
IDLE_HTTP = 200  # idle connections to the HTTP API


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def thread_count(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


def test_strangers_at_every_port_neither_slow_nor_break_a_pipeline(
    demo_model_dir: Path, pool: AgentPool, servers: list[ServeProcess], tmp_path: Path
) -> None:
    agent = pool.start("peer", real_roles=True)
    server = start_serve(
        tmp_path, demo_model_dir, pool.cluster_key,
        ["--parallelism", "pp", "--model-id", "demo", "--lost-after", "3"],
    )
    servers.append(server)
    cluster = server.cluster()
    assert cluster["strategy"] == "pp"
    stage_port = int(cluster["engine"]["stages"][1]["address"].rsplit(":", 1)[1])
    worker = next(m["worker_pid"] for m in cluster["members"] if m["node_id"] == agent.node_id)
    replans = cluster["replans"]
    http_port = int(server.base_url.rsplit(":", 1)[1])

    stream_all(server)  # warm-up
    quiet_texts, quiet_gaps = stream_all(server)
    fds, threads = open_fds(worker), thread_count(worker)
    with Strangers([stage_port, agent.port], http_port, PER_KIND, IDLE_HTTP) as strangers:
        time.sleep(0.5)  # every kind is pending at every port now
        started = time.monotonic()
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - started < 0.5
        busy_texts, busy_gaps = stream_all(server)
    assert busy_texts == quiet_texts  # every stream ran to the end with its own tokens
    assert strangers.reopened > 3 * PER_KIND * 2  # the cluster dropped them, they came back
    quiet, busy = statistics.median(quiet_gaps), statistics.median(busy_gaps)
    assert busy <= 1.5 * quiet + 0.005, (quiet, busy)
    assert max(busy_gaps) < 1.0, max(busy_gaps)  # before the gate: one stall of ~10 s
    after = server.cluster()
    assert after["replans"] == replans, after["last_replan_reason"]
    assert next(
        m["worker_pid"] for m in after["members"] if m["node_id"] == agent.node_id
    ) == worker  # nothing was replaced
    deadline = time.monotonic() + 5
    while (open_fds(worker) > fds + 2 or thread_count(worker) > threads) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert open_fds(worker) <= fds + 2  # nothing of the strangers' remains in the stage
    assert thread_count(worker) <= threads


def test_idle_and_trickling_http_clients_are_closed_and_starve_nobody(
    demo_model_dir: Path, servers: list[ServeProcess], tmp_path: Path
) -> None:
    server = start_serve(
        tmp_path, demo_model_dir, "tandem-" + "A" * 43,
        ["--parallelism", "single", "--model-id", "demo", "--http-header-timeout", "1"],
    )
    servers.append(server)
    port = int(server.base_url.rsplit(":", 1)[1])
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(IDLE_HTTP)]
    trickler = socket.create_connection(("127.0.0.1", port))
    try:
        started = time.monotonic()
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - started < 0.5
        closed_at = None
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 200:
            try:  # headers that never end, a byte at a time
                trickler.send(bytes([byte]))
            except OSError:
                closed_at = time.monotonic() - started
                break
            time.sleep(0.05)
        assert closed_at is not None and closed_at < 3.0  # the deadline, trickling or not
        silent[0].settimeout(3)
        assert silent[0].recv(64) == b""
        texts, _ = stream_all(server)
        assert all(texts)
    finally:
        for sock in [*silent, trickler]:
            sock.close()
