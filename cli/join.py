"""`tandem join`: run this machine as an agent of the cluster until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import ipaddress
import signal
import threading
from pathlib import Path

from discovery.directories import default_cache_dir, default_state_dir
from errors import ConfigError

from .options import (
    add_flag,
    add_interface_flag,
    add_key_flags,
    add_memory_budget_flag,
    env_default,
)

ROLE_SEPARATOR = "="
# A well-known port lets a hostfile name agents without ports; zeroconf advertises any port.
DEFAULT_CONTROL_PORT = 52300


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("join", help="offer this machine to a cluster as an agent")
    _add_connection_flags(parser)
    _add_resource_flags(parser)
    _add_liveness_flags(parser)
    parser.add_argument(
        "--role-module",
        action="append",
        default=None,
        metavar="ROLE=MODULE",
        help="run ROLE with `python -m MODULE` instead of the built-in module (repeatable) "
        "[env TANDEM_ROLE_MODULE, comma-separated]",
    )
    parser.set_defaults(run=run)


def _add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """How a coordinator reaches this agent: the cluster key, the interface, the port."""
    add_key_flags(parser)
    add_interface_flag(parser)
    # TANDEM_PORT belongs to serve's HTTP port, so the control port has its own twin.
    parser.add_argument(
        "--port",
        "--control-port",
        dest="control_port",
        type=int,
        default=env_default("CONTROL_PORT", DEFAULT_CONTROL_PORT, int),
        help="control port the coordinator dials (hostfiles assume the default); 0 picks a "
        "free one, which zeroconf advertises "
        f"[env TANDEM_CONTROL_PORT; default {DEFAULT_CONTROL_PORT}]",
    )


def _add_resource_flags(parser: argparse.ArgumentParser) -> None:
    """What this agent reports to the planner: its node id's home, its memory and its disk."""
    add_flag(
        parser,
        "--state-dir",
        default=default_state_dir(),
        cast=Path,
        help="where the node id lives",
    )
    add_flag(parser, "--memory-limit", help="report at most this much memory, e.g. 512M or 8G")
    add_memory_budget_flag(parser)
    add_flag(
        parser,
        "--cache-dir",
        default=default_cache_dir(),
        cast=Path,
        help="where models fetched from the coordinator are kept (under models/CONTENT-HASH); "
        "its free disk and the copies in it are reported to the coordinator's planner",
    )
    add_flag(
        parser,
        "--disk-limit",
        help="models received from coordinators may take at most this much disk, e.g. 20G "
        "(default: the free disk)",
    )


def _add_liveness_flags(parser: argparse.ArgumentParser) -> None:
    """How often this agent beats, and how long it waits for a silent coordinator."""
    add_flag(
        parser, "--heartbeat-interval", default=1.0, cast=float, help="seconds between heartbeats"
    )
    add_flag(
        parser,
        "--lost-after",
        default=5.0,
        cast=float,
        help="seconds of coordinator silence before the agent releases its worker",
    )


def read_cluster_key(args: argparse.Namespace, required: bool) -> bytes | None:
    """The key from --cluster-key or --cluster-key-file; ConfigError when required and absent."""
    from discovery.cluster_key import load_key_file, parse_key

    if args.cluster_key and args.cluster_key_file:
        raise ConfigError("give either --cluster-key or --cluster-key-file, not both")
    if args.cluster_key:
        return parse_key(args.cluster_key)
    if args.cluster_key_file:
        return load_key_file(Path(args.cluster_key_file))
    if required:
        raise ConfigError(
            f"tandem {args.command} needs the cluster key: pass --cluster-key (or "
            "TANDEM_CLUSTER_KEY) or --cluster-key-file; `tandem serve` creates it on first start"
        )
    return None


def check_interface(interface: str | None) -> None:
    """--interface must be an IPv4 address (zeroconf binds to addresses, not names)."""
    if not interface:
        return
    try:
        ipaddress.IPv4Address(interface)
    except ValueError:
        raise ConfigError(
            f"--interface wants this machine's IPv4 address (e.g. 192.168.1.20 or 127.0.0.1), "
            f"got {interface!r}"
        ) from None


def parse_role_modules(entries: list[str]) -> dict[str, str]:
    """{'tp_rank': 'my.module'} from ['tp_rank=my.module']."""
    table: dict[str, str] = {}
    for entry in entries:
        role, separator, module = entry.partition(ROLE_SEPARATOR)
        if not separator or not role.strip() or not module.strip():
            raise ConfigError(f"--role-module wants ROLE=MODULE, got {entry!r}")
        table[role.strip()] = module.strip()
    return table


def config_from_args(args: argparse.Namespace):  # -> AgentConfig (imported lazily)
    from discovery.agent_config import DEFAULT_ROLE_MODULES, AgentConfig
    from discovery.capabilities import parse_memory_size

    check_interface(args.interface)
    if not 0 <= args.control_port < 65536:
        raise ConfigError(f"--port must be 0..65535, got {args.control_port}")
    if args.heartbeat_interval <= 0 or args.lost_after <= args.heartbeat_interval:
        raise ConfigError(
            f"--lost-after ({args.lost_after}) must exceed --heartbeat-interval "
            f"({args.heartbeat_interval}), which must be positive"
        )
    role_entries = args.role_module
    if role_entries is None:
        role_entries = [item for item in env_default("ROLE_MODULE", "").split(",") if item]
    role_modules = dict(DEFAULT_ROLE_MODULES)
    role_modules.update(parse_role_modules(role_entries))
    key = read_cluster_key(args, required=True)
    assert key is not None
    return AgentConfig(
        cluster_key=key,
        state_dir=Path(args.state_dir).expanduser(),
        interface=args.interface or None,
        port=args.control_port,
        memory_limit=parse_memory_size(args.memory_limit) if args.memory_limit else None,
        memory_budget=parse_memory_size(args.memory_budget) if args.memory_budget else None,
        heartbeat_interval_s=args.heartbeat_interval,
        coordinator_timeout_s=args.lost_after,
        # Detected within the limit plus one heartbeat: inside the coordinator's --lost-after.
        worker_frozen_s=max(args.lost_after - 2 * args.heartbeat_interval, args.heartbeat_interval),
        role_modules=role_modules,
        cache_dir=Path(args.cache_dir).expanduser(),
        disk_limit=parse_memory_size(args.disk_limit) if args.disk_limit else None,
    )


def run(args: argparse.Namespace) -> int:
    from discovery.agent import Agent
    from discovery.capabilities import format_memory_size

    agent = Agent(config_from_args(args))
    stop = threading.Event()
    previous = {
        signum: signal.signal(signum, lambda *_: stop.set())
        for signum in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        agent.start()
        capabilities = agent.capabilities
        assert capabilities is not None
        available = format_memory_size(capabilities.memory_available)
        total = format_memory_size(capabilities.memory_total)
        # Scripts (and tests/helpers/cluster.py) wait for this line.
        print(
            f"tandem join: node {agent.node_id} ready on {agent.bind_host}:{agent.control_port} "
            f"(cluster {agent.cluster_id}, memory {available} of {total} available, "
            f"backends {','.join(capabilities.backends)})",
            flush=True,
        )
        agent.wait(stop)
    finally:
        agent.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    print(f"tandem join: node {agent.node_id} stopped", flush=True)
    return 0
