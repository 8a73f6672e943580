"""A JACCL plan launches JACCL: the device matrix, the rank specs and the worker's environment.

JACCL itself needs Thunderbolt RDMA between Macs, which this machine has not: these tests stop
at the process spec and the MLX_* environment a rank starts with.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines.cluster.launch import LaunchSettings, _group_specs
from engines.core.engine_options import EngineOptions
from engines.tensor_parallel.group import WorkerSpec, group_environment
from engines.tensor_parallel.jaccl import RdmaRow, device_matrix
from planner import NodeResources, Parallelism, PlanError, plan_cluster
from tests.helpers.planning import MB, SHAPE

MACS = ("mac0", "mac1", "mac2")
ADDRESSES = {"mac0": "10.0.0.1", "mac1": "10.0.0.2", "mac2": "10.0.0.3"}
# Three Macs cabled in a full mesh, as mlx.distributed_config writes it (row i: rank i's devices).
MESH = (
    RdmaRow(("10.0.0.1",), (None, "rdma_en3", "rdma_en4")),
    RdmaRow(("10.0.0.2",), ("rdma_en3", None, "rdma_en5")),
    RdmaRow(("10.0.0.3",), ("rdma_en4", "rdma_en5", None)),
)


def test_two_macs_with_one_active_device_each_need_no_hostfile():
    matrix = device_matrix(MACS[:2], ADDRESSES, {"mac0": ["rdma_en3"], "mac1": ["rdma_en5"]})
    assert matrix == [[None, "rdma_en3"], ["rdma_en5", None]]


@pytest.mark.parametrize(
    ("active", "message"),
    [
        ({"mac0": ["rdma_en3", "rdma_en4"], "mac1": ["rdma_en5"]}, "mac0 has 2, mac1 has 1"),
        ({"mac0": ["rdma_en3"]}, "mac0 has 1, mac1 has 0"),
    ],
)
def test_two_macs_whose_link_is_ambiguous_are_refused_by_name(active, message):
    with pytest.raises(PlanError, match=message):
        device_matrix(MACS[:2], ADDRESSES, active)


def test_three_macs_without_a_hostfile_are_refused():
    active = {mac: ["rdma_en3", "rdma_en4"] for mac in MACS}
    with pytest.raises(PlanError, match="3 machines needs to know which RDMA device"):
        device_matrix(MACS, ADDRESSES, active)


def test_the_hostfile_maps_devices_in_rank_order_whatever_the_row_order():
    ranks = ("mac0", "mac2", "mac1")  # the plan's rank order, not the hostfile's
    assert device_matrix(ranks, ADDRESSES, {}, MESH) == [
        [None, "rdma_en4", "rdma_en3"],
        ["rdma_en4", None, "rdma_en5"],
        ["rdma_en3", "rdma_en5", None],
    ]


def test_a_missing_link_or_an_unknown_machine_is_refused():
    broken = (MESH[0], RdmaRow(("10.0.0.2",), ("rdma_en3", None, None)), MESH[2])
    with pytest.raises(PlanError, match="no RDMA link from mac1 to mac2"):
        device_matrix(MACS, ADDRESSES, {}, broken)
    with pytest.raises(PlanError, match=r"mac2 \(10.0.0.9\) is on no row"):
        device_matrix(MACS, {**ADDRESSES, "mac2": "10.0.0.9"}, {}, MESH)


def plan_for(backends: tuple[str, ...], collective: str | None):
    nodes = [NodeResources(mac, ADDRESSES[mac], 1024 * MB, backends) for mac in MACS[:2]]
    return plan_cluster(Parallelism.TP, SHAPE, nodes, collective=collective)


def settings(**extra) -> LaunchSettings:
    return LaunchSettings(Path("/models/m"), b"k" * 32, "10.0.0.1", **extra)


def test_a_jaccl_plan_launches_jaccl_ranks_and_a_ring_plan_the_ring(tmp_path):
    jaccl_plan = plan_for(("jaccl", "ring"), None)
    assert jaccl_plan.backend == "jaccl"
    devices = {"mac0": ("rdma_en3",), "mac1": ("rdma_en5",)}
    rank_addresses = [ADDRESSES[mac] for mac in jaccl_plan.ranks]
    specs = _group_specs(
        jaccl_plan,
        settings(rdma_devices=devices),
        ADDRESSES,
        rank_addresses,
        [52400, 52401],
        EngineOptions(max_batch=4),
    )
    assert [spec["backend"] for spec in specs] == ["jaccl", "jaccl"]
    assert specs[1]["ibv_devices"] == [[None, "rdma_en3"], ["rdma_en5", None]]
    assert {spec["jaccl_coordinator"] for spec in specs} == {"10.0.0.1:52400"}
    environment = group_environment(WorkerSpec.from_dict(specs[1]), tmp_path)
    assert environment["MLX_RANK"] == "1"
    assert environment["MLX_JACCL_COORDINATOR"] == "10.0.0.1:52400"
    assert json.loads(Path(environment["MLX_IBV_DEVICES"]).read_text()) == specs[1]["ibv_devices"]
    assert "MLX_HOSTFILE" not in environment

    ring_plan = plan_for(("ring",), "ring")
    assert ring_plan.backend == "ring"
    specs = _group_specs(
        ring_plan, settings(), ADDRESSES, rank_addresses, [52400, 52401], EngineOptions()
    )
    assert [spec["backend"] for spec in specs] == ["ring", "ring"]
    environment = group_environment(WorkerSpec.from_dict(specs[0]), tmp_path)
    assert json.loads(Path(environment["MLX_HOSTFILE"]).read_text()) == [
        ["10.0.0.1:52400"],
        ["10.0.0.2:52401"],
    ]


def test_a_jaccl_plan_without_known_links_fails_closed():
    jaccl_plan = plan_for(("jaccl", "ring"), None)
    with pytest.raises(PlanError, match="JACCL over 2 machines"):
        _group_specs(
            jaccl_plan, settings(), ADDRESSES, ["10.0.0.1", "10.0.0.2"], [1, 2], EngineOptions()
        )
