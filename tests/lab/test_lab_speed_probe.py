"""The speed probe on a lab machine held to a CPU quota: it reads the share of a core the
machine keeps when busy (its cgroup's quota over the cores it may use, as the machine itself
sees its cgroups), which the cost model needs to predict a pipeline stage that rests while the
others work; and the layer time it reports is the throttled one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lab.machines import Lab, MachineSpec, lab_unavailable

pytestmark = [
    pytest.mark.lab,
    pytest.mark.skipif(bool(lab_unavailable()), reason=lab_unavailable() or "lab available"),
]

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def probe(lab: Lab, index: int, config: dict) -> float:
    machine = lab.machines[index]
    spec = {"config": config, "rows": [1], "prefill_chunk": 32, "blas_threads": 1}
    done = subprocess.run(
        machine.command([sys.executable, "-m", "engines.model.speed_probe"]),
        input=json.dumps(spec) + "\n", env=machine.env(), cwd=PROJECT_ROOT,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    ready = [line for line in lines if line.get("event") == "ready"]
    assert ready, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    return ready[0]["speed"]


def test_the_probe_reads_a_cpu_quota_as_the_share_of_a_core_kept(demo_model_dir: Path) -> None:
    config = json.loads((demo_model_dir / "config.json").read_text())
    specs = [MachineSpec(cores="0", cpu_quota=0.3), MachineSpec(cores="1")]
    with Lab(2, specs) as lab:
        held = probe(lab, 0, config)
        free = probe(lab, 1, config)
    assert (held["cpu_share"], free["cpu_share"]) == (0.3, 1.0)
    # sustained steps under the quota: ~3x the free machine's (noise allowed)
    assert held["layer"][0][1] > 1.8 * free["layer"][0][1], (held["layer"], free["layer"])
