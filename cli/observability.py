"""`tandem serve` flags for seeing the cluster: the request log, open /metrics and dashboard."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from errors import ConfigError

from .options import add_flag

ON_OFF = ["off", "on"]
STDOUT = "-"


@dataclass(frozen=True, slots=True)
class ObservabilityConfig:
    """The request log's destinations, and which observation pages skip the API key."""

    request_log: Path | None = None
    request_log_stdout: bool = False
    request_log_max_bytes: int = 10 * 1024 * 1024
    request_log_backups: int = 5
    request_log_prompts: bool = False
    metrics_open: bool = False
    dashboard_open: bool = False


def add_observability_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser,
        "--request-log",
        help="write one JSON line per finished request to this file (rotated); '-' for stdout",
    )
    add_flag(
        parser,
        "--request-log-stdout",
        default="off",
        choices=ON_OFF,
        help="also write the request log lines to stdout",
    )
    add_flag(
        parser,
        "--request-log-max-bytes",
        default=10 * 1024 * 1024,
        cast=int,
        help="rotate the request log file at this size",
    )
    add_flag(
        parser, "--request-log-backups", default=5, cast=int, help="rotated request log files kept"
    )
    add_flag(
        parser,
        "--request-log-prompts",
        default="off",
        choices=ON_OFF,
        help="on: put each request's prompt text in its log line (off: never)",
    )
    add_flag(
        parser,
        "--metrics-open",
        default="off",
        choices=ON_OFF,
        help="on: /metrics answers without the --api-key (a trusted network)",
    )
    add_flag(
        parser,
        "--dashboard-open",
        default="off",
        choices=ON_OFF,
        help="on: the dashboard (/) and the chat page (/chat) need no --api-key (a trusted "
        "network)",
    )


def observability_from_args(args: argparse.Namespace) -> ObservabilityConfig:
    if args.request_log_max_bytes < 0 or args.request_log_backups < 0:
        raise ConfigError(
            "--request-log-max-bytes and --request-log-backups must be at least 0, got "
            f"{args.request_log_max_bytes} and {args.request_log_backups}"
        )
    to_stdout = args.request_log == STDOUT
    return ObservabilityConfig(
        request_log=None if (to_stdout or not args.request_log) else Path(args.request_log),
        request_log_stdout=to_stdout or args.request_log_stdout == "on",
        request_log_max_bytes=args.request_log_max_bytes,
        request_log_backups=args.request_log_backups,
        request_log_prompts=args.request_log_prompts == "on",
        metrics_open=args.metrics_open == "on",
        dashboard_open=args.dashboard_open == "on",
    )
