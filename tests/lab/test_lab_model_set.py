"""Several models on three lab machines under memory cgroups (issue 40): a set that fits no way
is refused before anything loads, and a set that fits only one way is placed that way, each
model answering as it does alone, nothing OOM-killed."""

from __future__ import annotations

import re
import shutil
import threading
import time
from subprocess import Popen
from typing import Any

import httpx
import pytest
from openai import OpenAI

from discovery.cluster_key import format_key, generate_key
from tests.helpers.reference import MAX_TOKENS, PROMPTS, single_outputs
from tests.lab.agents import PYTHON, REPO, join
from tests.lab.machines import Lab, Machine, MachineSpec, lab_unavailable

pytestmark = [
    pytest.mark.lab,
    pytest.mark.skipif(bool(lab_unavailable()), reason=lab_unavailable() or "lab available"),
]

PORT = 8000
READY_S = 90.0
MB = 1024 * 1024
# Every stage's need counts 10 sequences x 8192 tokens of KV: per layer ~180 MB for BIG (8 KV
# heads), ~45 MB for SMALL (2 KV heads); the weights are a few MB.
BIG = {"layers": 6, "kv_heads": 8}  # ~1.07 GB in all
OTHER_BIG = {**BIG, "seed": 5}
SMALL = {"layers": 8, "heads": 4, "kv_heads": 2, "seed": 3}  # ~0.36 GB in all
SIZING = ["--parallelism", "pp", "--context-tokens", "8192", "--max-batch", "10",
          "--prefix-cache-bytes", "0", "--measure-speeds", "off"]  # fmt: skip
# The coordinator, a roomy agent and a tight one. Each offers its limit less what runs there
# (serve or join: 30-100 MB). BIG needs more than the coordinator and the tight agent hold
# together: the roomy one. SMALL needs more than the coordinator has left beside BIG's first
# stage: the tight one. Two BIGs would both need the roomy one. Both hold (planner/placement.py's
# candidates worked through) with every machine's memory anywhere within 30% of 400 MB, 2 GB
# and 480 MB.
LIMITS = (500 * MB, 2100 * MB, 580 * MB)


def wait_ready(machines: list[Machine]) -> None:
    """Until every agent listens (its `ready on` line), so that serve's browse finds it."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if all("ready on" in (m.home / "join.log").read_text() for m in machines):
            return
        time.sleep(0.2)
    pytest.fail(f"agents never ready:\n{(machines[0].home / 'join.log').read_text()[-2000:]}")


def start_serve(coordinator: Machine, key: str, name: str, models: list[str]) -> Popen:
    """`tandem serve` of the models copied to the coordinator's home (ids: their names)."""
    chosen = [flag for model in models for flag in ("--model", str(coordinator.home / model))]
    return coordinator.popen(
        [*PYTHON, "serve", *chosen, *SIZING, "--collective", "ring",
         "--interface", coordinator.address, "--host", coordinator.address, "--port", str(PORT),
         "--cluster-key", key, "--lost-after", "3", "--discovery-timeout", "3"],
        log=coordinator.home / f"{name}.log", cwd=REPO,
    )  # fmt: skip


def wait_healthy(coordinator: Machine, server: Popen, name: str) -> str:
    url = f"http://{coordinator.address}:{PORT}"
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                return url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    log = (coordinator.home / f"{name}.log").read_text()
    pytest.fail(f"serve never became healthy:\n{log[-3000:]}")


def answers(url: str, model_id: str) -> list[str]:
    client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=60)
    replies = [
        client.completions.create(model=model_id, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        for p in PROMPTS
    ]
    return [reply.choices[0].text for reply in replies]


def test_a_set_that_fits_no_way_is_refused_and_one_that_fits_one_way_is_placed_that_way(
    demo_model_factory: Any,
) -> None:
    models = {
        "big": demo_model_factory(**BIG),
        "other-big": demo_model_factory(**OTHER_BIG),
        "small": demo_model_factory(**SMALL),
    }
    references: dict[str, list[str]] = {}
    # what each model says alone, worked out while the lab starts
    alone = threading.Thread(
        daemon=True,
        target=lambda: references.update({m: single_outputs(models[m]) for m in ("big", "small")}),
    )
    alone.start()
    with Lab(3, [MachineSpec(memory_limit=limit) for limit in LIMITS]) as lab:
        coordinator, roomy, tight = lab.machines
        for name, model in models.items():
            shutil.copytree(model, coordinator.home / name)  # the agents cannot see them
        key = format_key(generate_key())
        join(roomy, key)
        join(tight, key)
        wait_ready([roomy, tight])
        agents = {machine.index: machine.pids() for machine in (roomy, tight)}

        # Two BIGs: each fits alone, over the coordinator and the roomy agent, not both at once.
        refused = start_serve(coordinator, key, "refused", ["big", "other-big"])
        assert refused.wait(60) == 2
        log = (coordinator.home / "refused.log").read_text()
        errors = [line for line in log.splitlines() if line.startswith("tandem: error:")]
        machine = r"\S+ [\d.]+ [MG]B \(cgroup v1 limit\)"
        assert len(errors) == 1 and re.search(
            rf"refusing to serve: cannot place the set on {machine}, {machine}, {machine}: "
            r"(other-)?big on .*needs [\d.]+ [MG]B, has [\d.]+ [MG]B",
            errors[0],
        ), log[-3000:]
        assert "loaded layers" not in log, log[-3000:]
        assert coordinator.pids() == []  # serve and its engine core are gone
        for agent in (roomy, tight):  # no stage was started: each runs its `join` alone
            assert agent.pids() == agents[agent.index], agent.index
            assert "started pp_stage worker" not in (agent.home / "join.log").read_text()

        # BIG and SMALL fit one way: BIG over the coordinator and the roomy agent, SMALL over
        # the coordinator and the tight one.
        server = start_serve(coordinator, key, "placed", ["big", "small"])
        url = wait_healthy(coordinator, server, "placed")
        cluster = httpx.get(url + "/v1/cluster", timeout=10).json()
        by_address = {m["address"].split(":")[0]: m for m in cluster["members"] if m["verified"]}
        bounds = [cluster["coordinator"], *by_address.values()]
        assert [node["memory_bound"] for node in bounds] == ["cgroup v1 limit"] * 3
        me = cluster["coordinator"]["node_id"]
        roomy_id, tight_id = (by_address[m.address]["node_id"] for m in (roomy, tight))
        placements = httpx.get(url + "/v1/placements", timeout=30).json()
        assert placements["current"] == {
            "big": {"state": "ok", "nodes": [me, roomy_id], "relayed": False},
            "small": {"state": "ok", "nodes": [me, tight_id], "relayed": False},
        }, placements
        preview = placements["preview"]  # placed afresh over the machines as they are now
        assert preview["refusal"] is None and preview["candidate_count"] == 1, preview
        assert [(m["model_id"], m["strategy"], m["nodes"]) for m in preview["models"]] == [
            ("big", "pp=2", [me, roomy_id]),
            ("small", "pp=2", [me, tight_id]),
        ]
        alone.join(120)
        assert references["big"] != references["small"]  # else a wrong routing could pass
        assert {m: answers(url, m) for m in ("big", "small")} == references
        assert [machine.oom_kills() for machine in lab.machines] == [0, 0, 0]
