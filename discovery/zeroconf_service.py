"""The `_tandem._tcp.local.` zeroconf record: its TXT fields, advertising and browsing it."""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass

from zeroconf import (
    DNSQuestionType,
    InterfaceChoice,
    IPVersion,
    NonUniqueNameException,
    ServiceBrowser,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
    get_all_addresses,
)

from discovery.capabilities import RdmaDevice
from errors import ConfigError

logger = logging.getLogger(__name__)

SERVICE_TYPE = "_tandem._tcp.local."
TXT_VERSION = "1"
ANY_ADDRESS = "0.0.0.0"
RESOLVE_TIMEOUT_MS = 3000
# Ask for multicast answers: several processes share port 5353 (on one machine, or in tests),
# and a unicast (QU) answer reaches only one of them, not necessarily the one that asked.
QUESTION_TYPE = DNSQuestionType.QM


@dataclass(frozen=True, slots=True)
class PeerRecord:
    """One agent as zeroconf shows it; nothing here is verified until the handshake."""

    node_id: str
    addresses: tuple[str, ...]
    port: int
    cluster_id: str
    version: str
    platform: str
    memory_total: int
    memory_available: int
    backends: tuple[str, ...]
    rdma_devices: tuple[RdmaDevice, ...]

    @property
    def address(self) -> str:
        return self.addresses[0] if self.addresses else ""


def open_zeroconf(interface: str | None) -> Zeroconf:
    """A Zeroconf bound to one IPv4 address, or to every interface when interface is None."""
    interfaces = [interface] if interface and interface != ANY_ADDRESS else InterfaceChoice.All
    try:
        return Zeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)
    except OSError as error:
        raise ConfigError(
            f"cannot start zeroconf on interface {interface or 'all'}: {error}"
        ) from error


def advertised_addresses(interface: str | None) -> list[str]:
    """The addresses an agent announces: its interface, or every non-loopback IPv4 address."""
    if interface and interface != ANY_ADDRESS:
        return [interface]
    addresses = [address for address in get_all_addresses() if not address.startswith("127.")]
    return addresses or ["127.0.0.1"]


def encode_txt(record: PeerRecord) -> dict[str, str]:
    """TXT properties for a record; each value stays well under the 255-byte TXT limit."""
    return {
        "txtvers": TXT_VERSION,
        "node": record.node_id,
        "cluster": record.cluster_id,
        "version": record.version,
        "platform": record.platform,
        "mem_total": str(record.memory_total),
        "mem_avail": str(record.memory_available),
        "backends": ",".join(record.backends),
        "rdma": ",".join(f"{device.name}={device.port_state}" for device in record.rdma_devices),
        "port": str(record.port),
    }


def decode_txt(
    properties: dict[bytes, bytes | None], addresses: tuple[str, ...], port: int
) -> PeerRecord:
    """A PeerRecord from TXT properties; ValueError when a required field is missing or bad."""
    text = {
        key.decode("utf-8", "replace"): (value or b"").decode("utf-8", "replace")
        for key, value in properties.items()
    }
    node_id = text.get("node", "")
    if not node_id:
        raise ValueError("TXT record has no node id")
    rdma = []
    for item in filter(None, text.get("rdma", "").split(",")):
        name, _, state = item.partition("=")
        rdma.append(RdmaDevice(name, state or "UNKNOWN"))
    return PeerRecord(
        node_id=node_id,
        addresses=addresses,
        port=int(text.get("port") or port),
        cluster_id=text.get("cluster", ""),
        version=text.get("version", ""),
        platform=text.get("platform", ""),
        memory_total=int(text.get("mem_total") or 0),
        memory_available=int(text.get("mem_avail") or 0),
        backends=tuple(filter(None, text.get("backends", "").split(","))),
        rdma_devices=tuple(rdma),
    )


def build_service_info(record: PeerRecord) -> ServiceInfo:
    """The zeroconf ServiceInfo of an agent; the instance name is the node id."""
    return ServiceInfo(
        SERVICE_TYPE,
        f"{record.node_id}.{SERVICE_TYPE}",
        port=record.port,
        properties=encode_txt(record),
        server=f"tandem-{record.node_id}.local.",
        parsed_addresses=list(record.addresses),
    )


def register_record(zeroconf: Zeroconf, record: PeerRecord) -> ServiceInfo:
    """Announce a record; a node id already on the network raises ConfigError."""
    info = build_service_info(record)
    try:
        zeroconf.register_service(info, allow_name_change=False)
    except NonUniqueNameException:
        raise ConfigError(duplicate_message(record.node_id, "the zeroconf name is taken")) from None
    return info


def duplicate_message(node_id: str, where: str) -> str:
    return (
        f"duplicate node id {node_id}: another agent already uses it ({where}); "
        "each machine needs its own node id: delete the node-id file in one agent's "
        "--state-dir (a cloned machine) or give it another --state-dir"
    )


def browse_records(zeroconf: Zeroconf, timeout_s: float) -> list[PeerRecord]:
    """Every tandem agent that answers within timeout_s, resolved, sorted by node id."""
    names: set[str] = set()
    lock = threading.Lock()

    def on_change(
        zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        with lock:
            if state_change is ServiceStateChange.Removed:
                names.discard(name)
            else:
                names.add(name)

    browser = ServiceBrowser(
        zeroconf, SERVICE_TYPE, handlers=[on_change], question_type=QUESTION_TYPE
    )
    try:
        time.sleep(timeout_s)
    finally:
        browser.cancel()
    with lock:
        found = sorted(names)
    # Resolve in parallel, so one silent name costs one timeout, not one each.
    results: dict[str, PeerRecord | None] = {}
    threads = [
        threading.Thread(
            target=lambda n=name: results.__setitem__(n, resolve_record(zeroconf, n)), daemon=True
        )
        for name in found
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=RESOLVE_TIMEOUT_MS / 1000 + 1.0)
    records = [record for name in found if (record := results.get(name))]
    return sorted(records, key=lambda record: record.node_id)


def resolve_record(zeroconf: Zeroconf, name: str) -> PeerRecord | None:
    """The PeerRecord behind one service name, or None when it does not resolve or parse."""
    info = ServiceInfo(SERVICE_TYPE, name)
    if not info.load_from_cache(zeroconf) and not info.request(
        zeroconf, RESOLVE_TIMEOUT_MS, question_type=QUESTION_TYPE
    ):
        logger.info("service %s did not resolve in %d ms", name, RESOLVE_TIMEOUT_MS)
        return None
    addresses = tuple(info.parsed_addresses(IPVersion.V4Only))
    try:
        return decode_txt(info.properties, addresses, info.port or 0)
    except ValueError as error:
        logger.warning("ignoring malformed tandem record %s: %s", name, error)
        return None


def check_not_advertised(zeroconf: Zeroconf, node_id: str, timeout_s: float) -> None:
    """Raise ConfigError when a live agent already advertises node_id."""
    for record in browse_records(zeroconf, timeout_s):
        if record.node_id == node_id and is_listening(record):
            where = f"at {record.address}:{record.port}"
            raise ConfigError(duplicate_message(node_id, where))
        if record.node_id == node_id:
            logger.info("stale record of node %s (nothing listens there); taking it over", node_id)


def is_listening(record: PeerRecord, timeout_s: float = 1.0) -> bool:
    """Whether anything accepts TCP at the record's control port (a stale record does not)."""
    for address in record.addresses:
        try:
            with socket.create_connection((address, record.port), timeout=timeout_s):
                return True
        except OSError:
            continue
    return False


class Advertisement:
    """One registered record on one Zeroconf; unregistering is idempotent and never raises."""

    def __init__(self, zeroconf: Zeroconf, record: PeerRecord) -> None:
        self._zeroconf = zeroconf
        self._info = register_record(zeroconf, record)

    def withdraw(self) -> None:
        info, self._info = self._info, None
        if info is None:
            return
        try:
            self._zeroconf.unregister_service(info)
        except Exception as error:  # noqa: BLE001 - shutdown must go on whatever zeroconf says
            logger.warning("could not unregister zeroconf service %s: %s", info.name, error)
