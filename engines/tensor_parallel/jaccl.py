"""Which RDMA device each tp rank uses to reach every other: JACCL's MLX_IBV_DEVICES matrix.

JACCL connects every pair of ranks over a Thunderbolt link, so it needs, for rank i and rank j,
the device on machine i whose cable ends at machine j. A hostfile's `rdma` rows say exactly that
(mlx.distributed_config writes them). Without one the links can only be inferred for two
machines that each have a single active device; anything else is refused by name, never run
over the wrong link or silently over the TCP ring.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from errors import PlanError

DeviceMatrix = list[list[str | None]]


@dataclass(frozen=True, slots=True)
class RdmaRow:
    """One hostfile row: the machine's addresses and, per hostfile rank, its device to it."""

    ips: tuple[str, ...]
    rdma: tuple[str | None, ...]


def device_matrix(
    ranks: Sequence[str],
    addresses: Mapping[str, str],
    active: Mapping[str, Sequence[str]],
    hostfile: Sequence[RdmaRow] = (),
) -> DeviceMatrix:
    """Row i, column j: the device rank i (node `ranks[i]`) reaches rank j through.

    `addresses` maps node id -> address, `active` node id -> its active RDMA devices (from its
    capabilities), `hostfile` the rows of --hostfile in hostfile order, row 0 the coordinator.
    """
    if hostfile:
        return _from_hostfile(ranks, addresses, hostfile)
    if len(ranks) == 2:
        first, second = (list(active.get(node, ())) for node in ranks)
        if len(first) == 1 and len(second) == 1:
            return [[None, first[0]], [second[0], None]]
        counts = ", ".join(f"{node} has {len(active.get(node, ()))}" for node in ranks)
        raise PlanError(
            f"JACCL over 2 machines infers the link only from one active RDMA device on each "
            f"({counts}); pass --hostfile with rdma rows (mlx.distributed_config writes one)"
        )
    raise PlanError(
        f"JACCL over {len(ranks)} machines needs to know which RDMA device of each reaches "
        "each other: pass --hostfile with rdma rows (mlx.distributed_config writes one)"
    )


def _from_hostfile(
    ranks: Sequence[str], addresses: Mapping[str, str], rows: Sequence[RdmaRow]
) -> DeviceMatrix:
    row_of: dict[str, int] = {}
    for rank, node in enumerate(ranks):
        if rank == 0:
            row_of[node] = 0  # the coordinator is the hostfile's first row
            continue
        found = [index for index, row in enumerate(rows) if addresses.get(node) in row.ips]
        if not found:
            raise PlanError(
                f"JACCL: {node} ({addresses.get(node)}) is on no row of the hostfile, so its "
                "RDMA devices are unknown"
            )
        row_of[node] = found[0]
    matrix: DeviceMatrix = []
    for node in ranks:
        devices = rows[row_of[node]].rdma
        line: list[str | None] = []
        for peer in ranks:
            device = None if peer == node else devices[row_of[peer]]
            if peer != node and device is None:
                raise PlanError(
                    f"JACCL: the hostfile lists no RDMA link from {node} to {peer}; cable "
                    "them (Thunderbolt) or use --collective ring"
                )
            line.append(device)
        matrix.append(line)
    return matrix
