"""The `tandem` command: parse flags, configure logging once, dispatch to a subcommand."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib import import_module

from errors import TandemError

from .options import env_default

# Subcommand modules, each with register(subparsers) and run(args) -> int.
SUBCOMMANDS = (
    "serve",
    "join",
    "peers",
    "plan",
    "demo_model",
    "gguf_import",
    "hostfile",
    "status",
)
# Long-running commands that end once they have closed everything they started: they leave
# without the interpreter's teardown, during which a garbage-collected mlx object can destroy
# a native thread still joinable and abort the process (exit -6 after a clean shutdown).
EXIT_WITHOUT_TEARDOWN = ("serve", "join")

LOG_FORMAT = "%(asctime)s %(levelname)s [%(process)d %(name)s] %(message)s"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Serve one language model from a cluster of machines.",
    )
    parser.add_argument(
        "--log-level",
        default=env_default("LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging verbosity [env TANDEM_LOG_LEVEL; default INFO]",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        import_module(f"cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT, stream=sys.stderr)
    code = _run(args)
    if args.command in EXIT_WITHOUT_TEARDOWN:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.run(args) or 0)
    except TandemError as error:
        print(f"tandem: error: {error}", file=sys.stderr)
        return getattr(error, "exit_status", 1)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
