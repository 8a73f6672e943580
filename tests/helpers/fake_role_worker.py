"""A stand-in role worker for agent tests: behaves as its payload's "mode" says.

ready: report ready (echoing the payload) and run until SIGTERM or stdin EOF.
fail: report failed and exit 1.  crash: write to stderr and exit 3.
stubborn: report ready and ignore SIGTERM (the agent must SIGKILL it).
progress: report "steps" progress events "every_s" apart (a model transfer of 1000 bytes
a step, of "total"), then ready, or nothing more when "then" is "stall".
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


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
    if mode == "progress":
        steps = int(payload.get("steps", 5))
        for step in range(1, steps + 1):
            time.sleep(float(payload.get("every_s", 0.2)))
            total = int(payload.get("total", steps * 1000))
            emit({"event": "progress", "done_bytes": step * 1000, "total_bytes": total})
        if payload.get("then") == "stall":
            while sys.stdin.readline():
                pass
            return 0
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    emit({"event": "ready", "pid": os.getpid(), "echo": payload})
    # stdin stays open while the agent lives: EOF means the agent is gone.
    while sys.stdin.readline():
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
