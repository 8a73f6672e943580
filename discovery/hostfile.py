"""Hostfiles in the mlx.launch JSON format: loading, validation, and what MLX needs from them.

A hostfile is a JSON list with one row per rank, rank 0 (the coordinator) first:
    {"ssh": "mac1", "ips": ["10.0.0.1"], "rdma": [null, "rdma_en3"]}
Rules, each checked with a message naming the row:
- `ssh` is required: a non-empty name without spaces.
- `ips` is optional (default []): a list of IP addresses. Rank 0 needs at least one, since
  peers reach the coordinator there; the ring backend needs one on every row.
- `rdma` is optional, but then on every row or on none. Row i's list has one entry per rank:
  the device (e.g. "rdma_en3") through which rank i reaches rank j, or null for no link.
  Entry i (the diagonal) is null. Links are symmetric: rdma[i][j] is set exactly when
  rdma[j][i] is, because a Thunderbolt cable has two ends.
- No two rows share an ssh name or an IP, except loopback ones (localhost, 127.0.0.0/8, ::1),
  which may repeat so several ranks can run on one machine.
- `control_port` is optional (tandem's own key, default 52300): the port `tandem join
  --control-port` listens on for that agent, so agents on other ports can be named in a hostfile.
- Keys starting with "_" (such as "_comment") are ignored, as mlx.launch ignores them; any
  other unknown key is an error, to catch typos like "rdam".
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path

from errors import ConfigError

KNOWN_KEYS = frozenset({"ssh", "ips", "rdma", "control_port"})
DEFAULT_CONTROL_PORT = 52300  # where `tandem join --port` listens unless a row says otherwise
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
MAX_PORT = 65535


@dataclass(frozen=True, slots=True)
class HostEntry:
    """One rank of a hostfile."""

    ssh: str
    ips: tuple[str, ...] = ()
    rdma: tuple[str | None, ...] | None = None
    control_port: int = DEFAULT_CONTROL_PORT


@dataclass(frozen=True, slots=True)
class Hostfile:
    """A validated hostfile; entry i is rank i."""

    entries: tuple[HostEntry, ...]

    @property
    def world_size(self) -> int:
        return len(self.entries)

    @property
    def has_rdma(self) -> bool:
        return self.entries[0].rdma is not None

    @property
    def control_host(self) -> str:
        """The address peers use to reach rank 0: its first IP."""
        return self.entries[0].ips[0]

    def ring_hostfile(self, base_port: int) -> list[list[str]]:
        """MLX_HOSTFILE for the ring backend: [["ip:port"], ...], rank i on base_port + i."""
        last_port = base_port + self.world_size - 1
        if base_port < 1 or last_port > MAX_PORT:
            raise ConfigError(
                f"ring ports {base_port}..{last_port} for {self.world_size} ranks must lie "
                f"in 1..{MAX_PORT}; choose another base port"
            )
        rows = []
        for rank, entry in enumerate(self.entries):
            if not entry.ips:
                raise ConfigError(
                    f"hostfile row {rank} (ssh {entry.ssh!r}) has no ips; the ring backend "
                    f"needs an IP address for every rank"
                )
            rows.append([_join_host_port(entry.ips[0], base_port + rank)])
        return rows

    def rdma_matrix(self) -> list[list[str | None]]:
        """MLX_IBV_DEVICES for JACCL: row i, column j = the device rank i uses to reach rank j."""
        if not self.has_rdma:
            raise ConfigError(
                "the hostfile has no rdma rows, so JACCL cannot be used; add an rdma list to "
                "every row or use the ring backend"
            )
        return [list(entry.rdma or ()) for entry in self.entries]

    def missing_rdma_links(self) -> list[tuple[int, int]]:
        """Rank pairs (i < j) without an RDMA link; JACCL's full mesh needs this to be empty."""
        if not self.has_rdma:
            return [(i, j) for i in range(self.world_size) for j in range(i + 1, self.world_size)]
        return [
            (i, j)
            for i, entry in enumerate(self.entries)
            for j in range(i + 1, self.world_size)
            if (entry.rdma or ())[j] is None
        ]

    def to_json(self) -> list[dict[str, object]]:
        """The rows in mlx.launch's format, without comments."""
        rows: list[dict[str, object]] = []
        for entry in self.entries:
            row: dict[str, object] = {"ssh": entry.ssh, "ips": list(entry.ips)}
            if entry.rdma is not None:
                row["rdma"] = list(entry.rdma)
            rows.append(row)
        return rows


def load_hostfile(path: Path) -> Hostfile:
    """Read and validate a hostfile; every problem is a ConfigError naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read hostfile {path}: {error}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"hostfile {path} is not valid JSON: {error.msg} at line {error.lineno} "
            f"column {error.colno}"
        ) from None
    try:
        return validate_hostfile(data)
    except ConfigError as error:
        raise ConfigError(f"hostfile {path}: {error}") from None


def validate_hostfile(data: object) -> Hostfile:
    """A Hostfile from parsed JSON, or a ConfigError naming the first rule it breaks."""
    if not isinstance(data, list):
        raise ConfigError(f"a hostfile is a JSON list of rows, got a JSON {_json_type(data)}")
    if not data:
        raise ConfigError("the hostfile has no rows; list at least rank 0")
    entries = tuple(_parse_row(index, row) for index, row in enumerate(data))
    if not entries[0].ips:
        raise ConfigError(
            f"row 0 (ssh {entries[0].ssh!r}) has no ips; rank 0 is the coordinator and needs "
            f"at least one IP address peers can reach"
        )
    _check_unique(entries)
    _check_rdma(entries)
    return Hostfile(entries)


def _parse_row(index: int, row: object) -> HostEntry:
    if not isinstance(row, dict):
        raise ConfigError(f"row {index} must be a JSON object, got a JSON {_json_type(row)}")
    unknown = sorted(key for key in row if key not in KNOWN_KEYS and not key.startswith("_"))
    if unknown:
        raise ConfigError(
            f"row {index} has unknown keys {unknown}; allowed are ssh, ips, rdma, control_port "
            f"(and comments starting with '_')"
        )
    ssh = row.get("ssh")
    if ssh is None:
        raise ConfigError(f"row {index} is missing 'ssh' (the host to reach this rank on)")
    if not isinstance(ssh, str) or not ssh.strip() or any(char.isspace() for char in ssh):
        raise ConfigError(f"row {index} 'ssh' must be a host name without spaces, got {ssh!r}")
    ips = row.get("ips", [])
    if not isinstance(ips, list):
        raise ConfigError(f"row {index} 'ips' must be a list of IP addresses, got {ips!r}")
    for position, ip in enumerate(ips):
        if not isinstance(ip, str) or not _is_ip(ip):
            raise ConfigError(f"row {index} ips[{position}] is not an IP address: {ip!r}")
    if len(set(ips)) != len(ips):
        raise ConfigError(f"row {index} lists an IP twice: {ips}")
    rdma = row.get("rdma")
    if rdma is not None:
        if not isinstance(rdma, list):
            raise ConfigError(f"row {index} 'rdma' must be a list of device names or null")
        for position, device in enumerate(rdma):
            if device is not None and (not isinstance(device, str) or not device.strip()):
                raise ConfigError(
                    f"row {index} rdma[{position}] must be a device name or null, got {device!r}"
                )
        rdma = tuple(rdma)
    port = row.get("control_port", DEFAULT_CONTROL_PORT)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port <= MAX_PORT:
        raise ConfigError(f"row {index} 'control_port' must be a port 1..{MAX_PORT}, got {port!r}")
    return HostEntry(ssh=ssh, ips=tuple(ips), rdma=rdma, control_port=port)


def _check_unique(entries: tuple[HostEntry, ...]) -> None:
    seen_ssh: dict[str, int] = {}
    seen_ips: dict[str, int] = {}
    for index, entry in enumerate(entries):
        name = entry.ssh.lower()
        if name in seen_ssh and not _is_loopback_name(name):
            raise ConfigError(
                f"rows {seen_ssh[name]} and {index} have the same ssh host {entry.ssh!r}; "
                f"each rank needs its own machine (only loopback hosts may repeat)"
            )
        seen_ssh.setdefault(name, index)
        for ip in entry.ips:
            canonical = str(ipaddress.ip_address(ip))
            if canonical in seen_ips and not ipaddress.ip_address(ip).is_loopback:
                raise ConfigError(
                    f"rows {seen_ips[canonical]} and {index} share the IP {ip}; "
                    f"each rank needs its own address (only loopback addresses may repeat)"
                )
            seen_ips.setdefault(canonical, index)


def _check_rdma(entries: tuple[HostEntry, ...]) -> None:
    with_rdma = [index for index, entry in enumerate(entries) if entry.rdma is not None]
    if not with_rdma:
        return
    world_size = len(entries)
    if len(with_rdma) != world_size:
        without = [index for index in range(world_size) if index not in with_rdma]
        raise ConfigError(
            f"rows {with_rdma} have 'rdma' but rows {without} do not; give every row an rdma "
            f"list (null where there is no link) or remove rdma everywhere"
        )
    for index, entry in enumerate(entries):
        rdma = entry.rdma or ()
        if len(rdma) != world_size:
            raise ConfigError(
                f"row {index} rdma has {len(rdma)} entries but the hostfile has {world_size} "
                f"rows; it needs one entry per rank: {list(rdma)}"
            )
        if rdma[index] is not None:
            raise ConfigError(
                f"row {index} rdma[{index}] is {rdma[index]!r} but must be null: "
                f"a rank needs no device to reach itself"
            )
    for index, entry in enumerate(entries):
        for other, device in enumerate(entry.rdma or ()):
            reverse = (entries[other].rdma or ())[index]
            if (device is None) != (reverse is None):
                raise ConfigError(
                    f"rdma links must be symmetric: row {index} rdma[{other}] is {device!r} "
                    f"but row {other} rdma[{index}] is {reverse!r}"
                )


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _is_loopback_name(name: str) -> bool:
    return name in LOOPBACK_NAMES or (_is_ip(name) and ipaddress.ip_address(name).is_loopback)


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _json_type(value: object) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}
    for kind, name in names.items():
        if isinstance(value, kind):
            return name
    return "number" if isinstance(value, int | float) else type(value).__name__
