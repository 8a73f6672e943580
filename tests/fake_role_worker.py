"""A stand-in role worker for agent tests: behaves as its payload's "mode" says.

ready: report ready (echoing the payload) and run until SIGTERM or stdin EOF.
fail: report failed and exit 1.  crash: write to stderr and exit 3.
stubborn: report ready and ignore SIGTERM (the agent must SIGKILL it).
"""

from __future__ import annotations

import json
import os
import signal
import sys


def emit(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main() -> int:
    payload = json.loads(sys.stdin.readline() or "{}")
    mode = payload.get("mode", "ready")
    if mode == "fail":
        emit({"event": "failed", "reason": f"fake failure for {payload.get('tag')}"})
        return 1
    if mode == "crash":
        sys.stderr.write("fake worker crashed on purpose\n")
        sys.stderr.flush()
        return 3
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    emit({"event": "ready", "pid": os.getpid(), "echo": payload})
    # stdin stays open while the agent lives: EOF means the agent is gone.
    while sys.stdin.readline():
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
