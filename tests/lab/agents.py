"""tandem on lab machines: the command line, and an agent joined to a cluster."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.lab.machines import Machine

PYTHON = [sys.executable, "-m", "cli.main"]  # this tree's tandem, run from REPO
REPO = Path(__file__).resolve().parents[2]


def join(machine: Machine, key: str) -> None:
    """`tandem join` on `machine`, with a fast heartbeat (a lost agent is noticed in 3 s)."""
    machine.popen(
        [*PYTHON, "join", "--cluster-key", key, "--interface", machine.address,
         "--heartbeat-interval", "0.5", "--lost-after", "3"],
        log=machine.home / "join.log", cwd=REPO,
    )  # fmt: skip
