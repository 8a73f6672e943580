"""The speed probe on a lab machine held to a CPU quota: it reads the share of a core the
machine keeps when busy (its cgroup's quota over the cores it may use, as the machine itself
sees its cgroups), which the cost model needs to predict a pipeline stage that rests while the
others work; and the layer time it reports is the throttled one. And the collective probe
between two lab machines: the all_sum tp would run, slower over a capped link, and a tp layer
of the model over the two, its all_sums included."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.lab.machines import Lab, MachineSpec, lab_unavailable

pytestmark = [
    pytest.mark.lab,
    pytest.mark.skipif(bool(lab_unavailable()), reason=lab_unavailable() or "lab available"),
]

PROJECT_ROOT = Path(__file__).resolve().parents[2]


MB = 1 << 20
# SmolLM2-135M's shape: its 49152-token vocabulary makes the embedding most of the probe's memory
VOCABULARY_HEAVY = {
    "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
    "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
    "vocab_size": 49152, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
}  # fmt: skip


def probe_answer(lab: Lab, index: int, config: dict) -> dict:
    """The probe's last protocol line on lab machine `index`: ready (with the speed) or failed."""
    machine = lab.machines[index]
    spec = {"config": config, "rows": [1], "prefill_chunk": 32, "blas_threads": 1}
    done = subprocess.run(
        machine.command([sys.executable, "-m", "engines.model.speed_probe"]),
        input=json.dumps(spec) + "\n", env=machine.env(), cwd=PROJECT_ROOT,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    answered = [line for line in lines if line.get("event") in ("ready", "failed")]
    assert answered, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    return answered[-1]


def probe(lab: Lab, index: int, config: dict) -> dict:
    answer = probe_answer(lab, index, config)
    assert answer["event"] == "ready", answer
    return answer["speed"]


def test_the_probe_reads_a_cpu_quota_as_the_share_of_a_core_kept(demo_model_dir: Path) -> None:
    config = json.loads((demo_model_dir / "config.json").read_text())
    specs = [MachineSpec(cores="0", cpu_quota=0.3), MachineSpec(cores="1")]
    with Lab(2, specs) as lab:
        held = probe(lab, 0, config)
        free = probe(lab, 1, config)
    assert (held["cpu_share"], free["cpu_share"]) == (0.3, 1.0)
    # sustained steps under the quota: ~3x the free machine's (noise allowed)
    assert held["layer"][0][1] > 1.8 * free["layer"][0][1], (held["layer"], free["layer"])


def test_a_probe_that_does_not_fit_is_skipped_with_the_numbers_never_oom_killed() -> None:
    # 200 MB holds the interpreter with mlx (~90 MB) but not the probe's ~250 MB of layers,
    # embedding and temporaries: unchecked, the OOM killer would end it (or, beside a serve,
    # whichever process is largest). 700 MB holds it.
    specs = [MachineSpec(memory_limit=200 * MB), MachineSpec(memory_limit=700 * MB)]
    with Lab(2, specs) as lab:
        tight = probe_answer(lab, 0, VOCABULARY_HEAVY)
        roomy = probe_answer(lab, 1, VOCABULARY_HEAVY)
        kills = [machine.oom_kills() for machine in lab.machines]
    assert tight["event"] == "failed", tight
    assert re.search(r"skipped: it needs ~\d+ MB .* \d+ MB are available \(cgroup v1 limit\)",
                     tight["reason"]), tight["reason"]  # fmt: skip
    assert roomy["event"] == "ready" and roomy["speed"]["layer"], roomy
    assert kills == [0, 0]


def collective(
    lab: Lab, ranks: tuple[int, int], hidden_size: int = 1024, config: dict | None = None
) -> dict:
    """Rank 0 on one lab machine, rank 1 on another, joined over the lab's bridge: rank 0's
    measurement (median seconds per all_sum by rows; with `config`, its tp layer and rest)."""
    machines = [lab.machines[index] for index in ranks]
    hosts = [[f"{machine.address}:52400"] for machine in machines]
    processes = [
        subprocess.Popen(
            machine.command([sys.executable, "-m", "engines.tensor_parallel.collective_probe"]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=machine.env(),
            cwd=PROJECT_ROOT,
            text=True,
        )
        for machine in machines
    ]
    for machine, process in zip(machines, processes, strict=True):
        machine.processes.append(process)  # stopped by the lab, should the test fail first

    def answer(rank: int) -> tuple[str, str]:
        spec = {"rank": rank, "hosts": hosts, "hidden_size": hidden_size, "rows": [1, 8]}
        if config is not None:
            spec["config"] = config
        # stdin closes after the spec: a rank leaves once it has answered
        return processes[rank].communicate(json.dumps(spec) + "\n", timeout=60)

    with ThreadPoolExecutor(2) as pool:  # both ranks at once: each waits for the other
        outputs = list(pool.map(answer, (0, 1)))
    ready = [json.loads(line) for line in outputs[0][0].splitlines() if '"ready"' in line]
    assert ready, outputs
    return ready[0]["collective"]


def by_rows(points: list[list[float]]) -> dict[int, float]:
    return {int(rows): seconds for rows, seconds in points}


def test_the_collective_probe_times_the_all_sum_and_a_tp_layer_between_two_machines(
    demo_model_dir: Path,
) -> None:
    config = json.loads((demo_model_dir / "config.json").read_text())
    # a core each, as bench_planner's machines: unpinned, two ranks sharing the host's cores
    # read 4-8 ms medians in some runs (a scheduler tick or two), whatever the link
    specs = [MachineSpec(cores="0"), MachineSpec(cores="1"), MachineSpec("1", link_rate="20mbit")]
    with Lab(3, specs) as lab:
        group = collective(lab, (0, 1), config=config)
        capped = by_rows(collective(lab, (0, 2))["all_sum"])
    free = by_rows(group["all_sum"])
    assert all(0 < seconds < 0.05 for seconds in free.values()), free
    # a tp layer runs 2 all_sums (of 256-wide rows here) and its shard's compute between them
    layer, rest = by_rows(group["tp_layer"]), by_rows(group["tp_rest"])
    assert all(layer[rows] > 2 * free[rows] for rows in (1, 8)), (layer, free)
    assert all(0 < seconds < 0.05 for seconds in [*layer.values(), *rest.values()]), group
    # 8 hidden states of 1024 float32 (32 KB) cross the ring both ways: ~13 ms at 20 Mbit/s
    assert capped[8] > 0.005 and capped[8] > 5 * free[8], (free, capped)
