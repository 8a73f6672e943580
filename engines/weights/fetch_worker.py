"""`python -m engines.weights.fetch_worker`: the `weights` role, a share fetched ahead of its stage.

A pipeline stage learns where the next stage listens only once that one is up, so stages
start one after another; their weights need not wait. The coordinator assigns this role to
every stage's agent at once: each receives its share (verified, resumable, with progress
events, engines/weights/fetch.py) into the agent's cache, says ready, and waits for the
release; the stage worker started next finds the copy and transfers nothing.

stdin: the spec's JSON line ({"model_path", "weights", "cluster_key"}), then EOF means stop.
stdout: JSON lines only (progress, then {"event": "ready"} or {"event": "failed"}).
"""

from __future__ import annotations

import json
import logging
import sys

from discovery.cluster_key import parse_key
from discovery.json_child import configure_child_logging, open_protocol_output
from engines.weights.fetch import model_for_assignment, progress_events
from errors import ConfigError, ModelError

log = logging.getLogger(__name__)


def run() -> int:
    """Fetch the assignment's model or share, report ready, wait for stdin to close."""
    configure_child_logging("weights[%(process)d]")
    output = open_protocol_output()
    line = sys.stdin.buffer.readline()
    try:
        spec = json.loads(line)
        key = parse_key(str(spec["cluster_key"]))
        path = model_for_assignment(
            str(spec["model_path"]), dict(spec["weights"]), key, progress_events(output)
        )
    except (ValueError, KeyError, TypeError, ConfigError, ModelError, OSError) as error:
        output.write({"event": "failed", "reason": f"cannot fetch the weights: {error}"})
        return 1
    log.info("weights in place at %s", path)
    output.write({"event": "ready", "path": str(path)})
    sys.stdin.buffer.read()  # until the agent releases this role (or goes away)
    return 0


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
