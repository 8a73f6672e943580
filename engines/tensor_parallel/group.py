"""Worker specs for a tensor-parallel group: who is which rank, and how mlx finds the others."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from discovery.framing import free_port
from engines.core.engine_options import DEFAULT_OPTIONS, EngineOptions
from errors import ConfigError

BACKENDS = ("ring", "jaccl")
# The longest idle gap between the group's header broadcasts: the idle latency a new request
# may wait for the other ranks, and how fast an idle group notices a lost peer.
DEFAULT_HEARTBEAT_S = 0.1
DEFAULT_SYNC_EVERY = 8
DEFAULT_STALL_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """The first stdin line of a rank worker, validated.

    ring:  `hosts` holds one list of "ip:port" per rank (the mlx.launch hostfile rows).
    jaccl: `ibv_devices` is the world_size x world_size RDMA device matrix (None on the
           diagonal) and `jaccl_coordinator` the "ip:port" rank 0 listens on.
    heartbeat_s: while idle, ranks meet in a header broadcast at most this far apart; 0
    makes idle ranks wait inside the broadcast (no added latency, but one busy core each).
    """

    rank: int
    world_size: int
    backend: str
    model_path: str
    hosts: tuple[tuple[str, ...], ...] = ()
    ibv_devices: tuple[tuple[str | None, ...], ...] = ()
    jaccl_coordinator: str = ""
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    sync_every: int = DEFAULT_SYNC_EVERY
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    # How the rank runs; its prefix-cache budgets are the whole group's, and each rank keeps
    # its shard of every entry under its own share of prefix_cache_dir.
    options: EngineOptions = EngineOptions()
    log_level: str = "INFO"
    # Where to fetch the model when this machine lacks it, and the key that channel needs.
    weights: dict[str, Any] | None = None
    cluster_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of size {self.world_size}")
        if self.backend == "ring" and len(self.hosts) != self.world_size:
            raise ValueError(
                f"ring backend needs one hosts row per rank: {len(self.hosts)} rows "
                f"for world size {self.world_size}"
            )
        if self.backend == "jaccl":
            if len(self.ibv_devices) != self.world_size or any(
                len(row) != self.world_size for row in self.ibv_devices
            ):
                raise ValueError(
                    f"jaccl backend needs a {self.world_size}x{self.world_size} ibv_devices matrix"
                )
            if not self.jaccl_coordinator:
                raise ValueError("jaccl backend needs jaccl_coordinator ('ip:port' of rank 0)")
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be at least 1, got {self.sync_every}")
        if self.heartbeat_s < 0 or self.stall_timeout_s <= 0:
            raise ValueError(
                f"heartbeat_s must be >= 0 and stall_timeout_s > 0, got "
                f"{self.heartbeat_s} and {self.stall_timeout_s}"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerSpec:
        """Parse a JSON spec; unknown keys are rejected so typos do not pass silently."""
        unknown = set(data) - set(cls.__slots__)
        if unknown:
            raise ValueError(f"unknown worker spec keys: {sorted(unknown)}")
        values = dict(data)
        values["hosts"] = tuple(tuple(row) for row in data.get("hosts", ()))
        values["ibv_devices"] = tuple(tuple(row) for row in data.get("ibv_devices", ()))
        values["model_path"] = str(data.get("model_path", ""))
        try:
            values["options"] = EngineOptions.from_document(data.get("options", {}))
            return cls(**values)
        except (TypeError, ConfigError) as error:  # a missing required key, a bad option
            raise ValueError(f"invalid worker spec: {error}") from error

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form written as the first stdin line of the worker."""
        data = {name: getattr(self, name) for name in self.__slots__}
        data["hosts"] = [list(row) for row in self.hosts]
        data["ibv_devices"] = [list(row) for row in self.ibv_devices]
        data["options"] = self.options.document()
        return data


def ring_specs(
    addresses: list[str],
    ports: list[int],
    model_path: str | Path,
    options: EngineOptions = DEFAULT_OPTIONS,
    **fields: Any,
) -> list[dict[str, Any]]:
    """One spec per rank for the ring backend; rank r listens on addresses[r]:ports[r]."""
    if len(addresses) != len(ports):
        raise ValueError(f"{len(addresses)} addresses but {len(ports)} ports")
    hosts = [[f"{address}:{port}"] for address, port in zip(addresses, ports, strict=True)]
    return [
        WorkerSpec.from_dict(
            {
                "rank": rank,
                "world_size": len(hosts),
                "backend": "ring",
                "hosts": hosts,
                "model_path": str(model_path),
                "options": options.document(),
                **fields,
            }
        ).to_dict()
        for rank in range(len(hosts))
    ]


def loopback_ring_specs(
    world_size: int,
    model_path: str | Path,
    options: EngineOptions = DEFAULT_OPTIONS,
    **fields: Any,
) -> list[dict[str, Any]]:
    """Ring specs for `world_size` ranks on 127.0.0.1 with fresh ports (tests, benchmarks)."""
    ports = [free_port() for _ in range(world_size)]
    return ring_specs(["127.0.0.1"] * world_size, ports, model_path, options, **fields)


def jaccl_specs(
    ibv_devices: list[list[str | None]],
    coordinator: str,
    model_path: str | Path,
    options: EngineOptions = DEFAULT_OPTIONS,
    **fields: Any,
) -> list[dict[str, Any]]:
    """One spec per rank for JACCL: the RDMA device matrix plus rank 0's 'ip:port'."""
    return [
        WorkerSpec.from_dict(
            {
                "rank": rank,
                "world_size": len(ibv_devices),
                "backend": "jaccl",
                "ibv_devices": ibv_devices,
                "jaccl_coordinator": coordinator,
                "model_path": str(model_path),
                "options": options.document(),
                **fields,
            }
        ).to_dict()
        for rank in range(len(ibv_devices))
    ]


def group_environment(spec: WorkerSpec, directory: Path) -> dict[str, str]:
    """The MLX_* variables `mx.distributed.init` reads, writing the files they point to."""
    environment = {"MLX_RANK": str(spec.rank)}
    if spec.backend == "ring":
        hostfile = directory / "hostfile.json"
        hostfile.write_text(json.dumps([list(row) for row in spec.hosts]))
        environment["MLX_HOSTFILE"] = str(hostfile)
    else:
        devices = directory / "ibv_devices.json"
        devices.write_text(json.dumps([list(row) for row in spec.ibv_devices]))
        environment["MLX_IBV_DEVICES"] = str(devices)
        environment["MLX_JACCL_COORDINATOR"] = spec.jaccl_coordinator
    return environment
