"""`tandem hostfile validate FILE`: check an mlx.launch hostfile without starting anything."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("hostfile", help="work with mlx.launch hostfiles")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    validate = actions.add_parser("validate", help="check a hostfile and print its ranks")
    validate.add_argument("file", type=Path)
    validate.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from discovery.hostfile import load_hostfile

    hostfile = load_hostfile(args.file)
    print(f"{args.file}: valid, {len(hostfile.entries)} rank(s)")
    for rank, entry in enumerate(hostfile.entries):
        rdma = ", ".join(d for d in (entry.rdma or []) if d) or "none"
        print(f"  rank {rank}: {entry.ssh}  ips={','.join(entry.ips) or '-'}  rdma={rdma}")
    return 0
