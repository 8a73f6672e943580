"""`tandem peers`: what discovery sees right now, and (with the key) which agents verify."""

from __future__ import annotations

import argparse
import json

from .join import check_interface, read_cluster_key
from .options import add_flag, add_interface_flag, add_key_flags

COLUMNS = (
    "NODE",
    "ADDRESS",
    "CLUSTER",
    "MEMORY (avail/total)",
    "BACKENDS",
    "RDMA",
    "VERSION",
    "STATUS",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("peers", help="list the agents zeroconf finds and verify them")
    add_interface_flag(parser)
    add_flag(parser, "--discovery-timeout", default=3.0, cast=float, help="seconds to browse")
    add_key_flags(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    check_interface(args.interface)
    key = read_cluster_key(args, required=False)
    rows = discover_rows(args.interface or None, args.discovery_timeout, key)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(
            f"no tandem agents answered within {args.discovery_timeout} s "
            f"on {args.interface or 'all interfaces'}"
        )
        return 0
    print_table([[format_cell(column, row) for column in COLUMNS] for row in rows])
    return 0


def discover_rows(interface: str | None, timeout_s: float, key: bytes | None) -> list[dict]:
    """One dict per agent seen: the zeroconf record plus, with a key, the verification result."""
    from discovery.membership import Membership, browse_peers

    if key is None:
        return [
            record_row(record, cluster="?", status="not checked (no cluster key given)")
            for record in browse_peers(interface, timeout_s)
        ]
    with Membership(key, interface=interface) as membership:
        members = membership.discover(timeout_s)
        our_cluster = membership.cluster_id
    rows = []
    for member in members:
        record = member.record
        cluster_id = (
            member.hello.cluster_id if member.hello else (record.cluster_id if record else "")
        )
        cluster = "match" if cluster_id == our_cluster else f"other ({cluster_id or '?'})"
        status = "verified" if member.state == "connected" else f"{member.state}: {member.reason}"
        if member.hello is not None:
            row = {
                "node_id": member.node_id,
                "address": f"{member.address}:{member.port}",
                "cluster": cluster,
                "memory_available": member.memory_available,
                "memory_total": member.hello.memory_total,
                "backends": list(member.hello.backends),
                "rdma": [f"{d.name}={d.port_state}" for d in member.hello.rdma_devices],
                "version": member.hello.version,
                "status": status,
            }
        elif record is not None:
            row = record_row(record, cluster=cluster, status=status)
        else:
            row = {
                "node_id": member.node_id,
                "address": f"{member.address}:{member.port}",
                "cluster": "?",
                "status": status,
            }
        rows.append(row)
    return rows


def record_row(record, cluster: str, status: str) -> dict:
    return {
        "node_id": record.node_id,
        "address": f"{record.address}:{record.port}",
        "cluster": cluster if cluster != "?" else f"? ({record.cluster_id})",
        "memory_available": record.memory_available,
        "memory_total": record.memory_total,
        "backends": list(record.backends),
        "rdma": [f"{device.name}={device.port_state}" for device in record.rdma_devices],
        "version": record.version,
        "status": status,
    }


def format_cell(column: str, row: dict) -> str:
    from discovery.capabilities import format_memory_size

    if column == "MEMORY (avail/total)":
        if "memory_total" not in row:
            return "-"
        available, total = row["memory_available"], row["memory_total"]
        return f"{format_memory_size(available)}/{format_memory_size(total)}"
    key = {
        "NODE": "node_id",
        "ADDRESS": "address",
        "CLUSTER": "cluster",
        "BACKENDS": "backends",
        "RDMA": "rdma",
        "VERSION": "version",
        "STATUS": "status",
    }[column]
    value = row.get(key, "-")
    if isinstance(value, list):
        return ",".join(value) or "-"
    return str(value)


def print_table(cells: list[list[str]]) -> None:
    widths = [
        max(len(line[index]) for line in [list(COLUMNS), *cells]) for index in range(len(COLUMNS))
    ]
    for line in [list(COLUMNS), *cells]:
        print(
            "  ".join(text.ljust(width) for text, width in zip(line, widths, strict=True)).rstrip()
        )
