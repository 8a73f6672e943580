"""Hostfile validation, one rule per test, and the shipped examples in hosts/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from discovery.hostfile import HostEntry, Hostfile, load_hostfile, validate_hostfile
from errors import ConfigError

HOSTS_DIR = Path(__file__).resolve().parents[2] / "hosts"


def two_nodes(**row1_changes: object) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = [
        {"ssh": "mac1", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en4"]},
        {"ssh": "mac2", "ips": ["10.0.0.2"], "rdma": ["rdma_en4", None]},
    ]
    rows[1].update(row1_changes)
    return rows


def assert_invalid(data: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        validate_hostfile(data)


def test_valid_two_node_hostfile() -> None:
    hostfile = validate_hostfile(two_nodes())
    assert hostfile.world_size == 2
    assert hostfile.entries[1] == HostEntry("mac2", ("10.0.0.2",), ("rdma_en4", None))
    assert hostfile.control_host == "10.0.0.1"


def test_not_a_list() -> None:
    assert_invalid({"hosts": []}, "a hostfile is a JSON list of rows, got a JSON object")


def test_empty() -> None:
    assert_invalid([], "the hostfile has no rows")


def test_row_not_an_object() -> None:
    assert_invalid(
        [{"ssh": "mac1", "ips": ["10.0.0.1"]}, "mac2"],
        "row 1 must be a JSON object, got a JSON string",
    )


def test_missing_ssh() -> None:
    rows = two_nodes()
    del rows[1]["ssh"]
    assert_invalid(rows, "row 1 is missing 'ssh'")


def test_ssh_must_be_a_name() -> None:
    assert_invalid(
        two_nodes(ssh="mac 2"), "row 1 'ssh' must be a host name without spaces, got 'mac 2'"
    )
    assert_invalid(two_nodes(ssh=2), "row 1 'ssh' must be a host name without spaces, got 2")


def test_unknown_key_is_refused_but_comments_are_ignored() -> None:
    assert_invalid(two_nodes(rdam=[]), r"row 1 has unknown keys \['rdam'\]")
    assert validate_hostfile(two_nodes(_comment="the second Mac")).world_size == 2


def test_ips_must_be_ip_addresses() -> None:
    assert_invalid(
        two_nodes(ips="10.0.0.2"), "row 1 'ips' must be a list of IP addresses, got '10.0.0.2'"
    )
    assert_invalid(
        two_nodes(ips=["mac2.local"]), r"row 1 ips\[0\] is not an IP address: 'mac2.local'"
    )
    assert_invalid(two_nodes(ips=["10.0.0.2", "10.0.0.2"]), "row 1 lists an IP twice")


def test_rank_zero_needs_an_ip() -> None:
    rows = two_nodes()
    rows[0]["ips"] = []
    assert_invalid(rows, "row 0 \\(ssh 'mac1'\\) has no ips; rank 0 is the coordinator")


def test_other_ranks_may_omit_ips() -> None:
    rows = two_nodes()
    del rows[1]["ips"]
    assert validate_hostfile(rows).entries[1].ips == ()


def test_rdma_on_some_rows_only() -> None:
    rows = two_nodes()
    del rows[1]["rdma"]
    assert_invalid(rows, r"rows \[0\] have 'rdma' but rows \[1\] do not")


def test_rdma_length_must_be_world_size() -> None:
    assert_invalid(
        two_nodes(rdma=["rdma_en4", None, "rdma_en5"]),
        r"row 1 rdma has 3 entries but the hostfile has 2 rows",
    )


def test_rdma_entries_are_names_or_null() -> None:
    assert_invalid(
        two_nodes(rdma=["rdma_en4", 5]), r"row 1 rdma\[1\] must be a device name or null, got 5"
    )
    assert_invalid(two_nodes(rdma="rdma_en4"), "row 1 'rdma' must be a list")


def test_rdma_diagonal_must_be_null() -> None:
    assert_invalid(
        two_nodes(rdma=["rdma_en4", "rdma_en5"]),
        r"row 1 rdma\[1\] is 'rdma_en5' but must be null",
    )


def test_rdma_links_must_be_symmetric() -> None:
    assert_invalid(
        two_nodes(rdma=[None, None]),
        r"rdma links must be symmetric: row 0 rdma\[1\] is 'rdma_en4' but row 1 rdma\[0\] is None",
    )


def test_duplicate_ssh_names() -> None:
    assert_invalid(two_nodes(ssh="MAC1"), "rows 0 and 1 have the same ssh host 'MAC1'")


def test_duplicate_ips() -> None:
    assert_invalid(two_nodes(ips=["10.0.0.1"]), "rows 0 and 1 share the IP 10.0.0.1")


def test_loopback_hosts_may_repeat() -> None:
    rows = [{"ssh": "localhost", "ips": ["127.0.0.1"]}, {"ssh": "localhost", "ips": ["127.0.0.1"]}]
    assert validate_hostfile(rows).world_size == 2


def test_load_reports_the_file_and_bad_json(tmp_path: Path) -> None:
    path = tmp_path / "hosts.json"
    path.write_text('[{"ssh": "mac1",}]')
    with pytest.raises(ConfigError, match=f"hostfile {path} is not valid JSON: .* line 1"):
        load_hostfile(path)
    path.write_text("[]")
    with pytest.raises(ConfigError, match=f"hostfile {path}: the hostfile has no rows"):
        load_hostfile(path)
    with pytest.raises(ConfigError, match="cannot read hostfile"):
        load_hostfile(tmp_path / "absent.json")


@pytest.mark.parametrize("path", sorted(HOSTS_DIR.glob("*.json")), ids=lambda path: path.name)
def test_every_shipped_example_validates(path: Path) -> None:
    hostfile = load_hostfile(path)
    assert hostfile.world_size >= 1
    assert len(hostfile.ring_hostfile(5000)) == hostfile.world_size


def test_the_documented_examples_are_shipped() -> None:
    names = {path.name for path in HOSTS_DIR.glob("*.json")}
    assert {"one-node.json", "two-nodes.json", "four-node-mesh.json", "loopback.json"} <= names
    readme = (HOSTS_DIR / "README.md").read_text()
    assert all(name in readme for name in names)


def test_ring_hostfile_shape() -> None:
    hostfile = load_hostfile(HOSTS_DIR / "loopback.json")
    ring = hostfile.ring_hostfile(29500)
    assert ring == [["127.0.0.1:29500"], ["127.0.0.1:29501"]]
    json.dumps(ring)  # MLX_HOSTFILE is this list as JSON


def test_ring_hostfile_needs_ips_and_valid_ports() -> None:
    rows = two_nodes()
    rows[1]["ips"] = []
    with pytest.raises(ConfigError, match=r"row 1 \(ssh 'mac2'\) has no ips; the ring backend"):
        validate_hostfile(rows).ring_hostfile(5000)
    with pytest.raises(ConfigError, match=r"ring ports 65535..65536 for 2 ranks"):
        validate_hostfile(two_nodes()).ring_hostfile(65535)


def test_ring_hostfile_brackets_ipv6() -> None:
    hostfile = Hostfile((HostEntry("a", ("fd00::1",)), HostEntry("b", ("fd00::2",))))
    assert hostfile.ring_hostfile(7000) == [["[fd00::1]:7000"], ["[fd00::2]:7001"]]


def test_rdma_matrix_and_missing_links() -> None:
    mesh = load_hostfile(HOSTS_DIR / "four-node-mesh.json")
    matrix = mesh.rdma_matrix()
    assert len(matrix) == 4 and all(len(row) == 4 for row in matrix)
    assert [matrix[i][i] for i in range(4)] == [None] * 4
    assert mesh.missing_rdma_links() == []
    rows = [
        {"ssh": "a", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en3", None]},
        {"ssh": "b", "rdma": ["rdma_en3", None, "rdma_en4"]},
        {"ssh": "c", "rdma": [None, "rdma_en4", None]},
    ]
    assert validate_hostfile(rows).missing_rdma_links() == [(0, 2)]


def test_rdma_matrix_without_rdma_is_an_error() -> None:
    with pytest.raises(ConfigError, match="the hostfile has no rdma rows, so JACCL cannot be used"):
        load_hostfile(HOSTS_DIR / "loopback.json").rdma_matrix()


def test_to_json_round_trips_without_comments() -> None:
    hostfile = load_hostfile(HOSTS_DIR / "two-nodes.json")
    rows = hostfile.to_json()
    assert all("_comment" not in row for row in rows)
    assert validate_hostfile(rows) == hostfile


def test_a_row_may_name_its_agents_control_port(tmp_path):
    from discovery.hostfile import DEFAULT_CONTROL_PORT, load_hostfile

    path = tmp_path / "hosts.json"
    rows = [
        {"ssh": "a", "ips": ["10.0.0.1"]},
        {"ssh": "b", "ips": ["10.0.0.2"], "control_port": 6000},
    ]
    path.write_text(json.dumps(rows))
    entries = load_hostfile(path).entries
    assert [entry.control_port for entry in entries] == [DEFAULT_CONTROL_PORT, 6000]
    path.write_text('[{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "control_port": "x"}]')
    with pytest.raises(ConfigError, match="row 1 'control_port' must be a port"):
        load_hostfile(path)
