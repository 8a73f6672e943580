"""AgentConfig: everything an agent needs to run, built by cli/join.py from flags and their
TANDEM_* twins, with the table of which module runs each role. Kept apart from the agent so
that its coordinator sessions can read the settings without importing the agent itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from discovery.handshake_gate import DEFAULT_DEADLINE_S

# Which module runs each role; an agent can be given another table (tests point a role at a fake).
DEFAULT_ROLE_MODULES: Mapping[str, str] = {
    "tp_rank": "engines.tensor_parallel.worker",
    "pp_stage": "engines.pipeline.stage_worker",
    "speed_probe": "engines.model.speed_probe",
    # a 2-rank group: all_sum, tp layer
    "collective_probe": "engines.tensor_parallel.collective_probe",
    "weights": "engines.weights.fetch_worker",  # a stage's share, fetched ahead of the stage
}


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Everything an agent needs; built by cli/join.py from flags and TANDEM_* twins."""

    cluster_key: bytes
    state_dir: Path
    interface: str | None = None  # None: every interface
    port: int = 0  # control port; 0 picks a free one (zeroconf advertises it)
    memory_limit: int | None = None
    memory_budget: int | None = None  # what the memory monitor measures tiers against
    heartbeat_interval_s: float = 1.0
    coordinator_timeout_s: float = 5.0
    worker_frozen_s: float = 3.0  # a ready worker whose process is stopped this long has failed
    handshake_timeout_s: float = DEFAULT_DEADLINE_S  # a coordinator proving the key
    duplicate_check_s: float = 1.5
    role_modules: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_ROLE_MODULES))
    cache_dir: Path | None = None  # where models fetched from a coordinator are kept
    disk_limit: int | None = None  # bytes the models there may take (None: the free disk)
