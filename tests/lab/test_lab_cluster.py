"""Three separate lab machines, each under a memory limit smaller than the model's weights and
KV: agents found by multicast zeroconf across the bridge, `single` refused with the numbers,
`auto` serving a pipeline over the three, the model sent to agents that lack it (a stage its
layers, a tp rank its slices), pp over three and tp over two answering what single answers,
8 streams at once, nothing OOM-killed, and a worker killed mid-stream turning into an error
event and a re-plan."""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import APIError, OpenAI

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
# Each machine's cgroup: less than the 6-layer model's weights + KV for 8 x 16k tokens (862 MB
# with headroom), more than a third of it plus the processes themselves.
MEMORY_LIMIT = 700 * MB
# The memory rule alone decides here (measuring speeds, which might pick two of the three, is
# tests/cluster/test_measured_planning.py's and bench_planner's), and no probe costs time.
PIPELINE = ["--max-batch", "8", "--context-tokens", "16384", "--prefix-cache-bytes", "0",
            "--measure-speeds", "off"]  # fmt: skip
TP = ["--context-tokens", "2048", "--prefix-cache-bytes", "0", "--measure-speeds", "off"]
STREAMS = 8


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab(3, [MachineSpec(memory_limit=MEMORY_LIMIT) for _ in range(3)]) as built:
        yield built


def serve(machine: Machine, key: str, parallelism: str, *extra: str) -> str:
    start_serve(machine, key, parallelism, *extra)
    url = f"http://{machine.address}:{PORT}"
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                return url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    log = (machine.home / f"serve-{parallelism}.log").read_text()
    pytest.fail(f"serve never became healthy:\n{log[-3000:]}")


def start_serve(machine: Machine, key: str, parallelism: str, *extra: str) -> Any:
    return machine.popen(
        [*PYTHON, "serve", "--parallelism", parallelism, "--collective", "ring",
         "--interface", machine.address, "--host", machine.address, "--port", str(PORT),
         "--cluster-key", key, "--model", str(machine.home / "model"), "--model-id", "demo",
         "--lost-after", "3", "--discovery-timeout", "3", *extra],
        log=machine.home / f"serve-{parallelism}.log", cwd=REPO,
    )


def many_streams(url: str) -> list[str]:
    """STREAMS completions at once; each one's finish reason."""
    client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0)
    reasons: list[str] = []

    def one(index: int) -> None:
        reply = client.completions.create(
            model="demo", prompt=f"stream {index} says", max_tokens=32, temperature=0.7
        )
        reasons.append(str(reply.choices[0].finish_reason))

    threads = [threading.Thread(target=one, args=(index,)) for index in range(STREAMS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return reasons


def answers(url: str) -> list[str]:
    client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=60)
    return [
        client.completions.create(model="demo", prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        .choices[0].text
        for p in PROMPTS
    ]


def test_three_machines_find_each_other_receive_the_model_and_answer_as_one(
    lab: Lab, demo_model_factory: Any
) -> None:
    key = format_key(generate_key())
    coordinator, first, second = lab.machines
    model = demo_model_factory(layers=6)
    shutil.copytree(model, coordinator.home / "model")  # the agents cannot see it
    join(first, key)
    join(second, key)

    # The whole model does not fit one machine's limit: single is refused with the numbers.
    refused = start_serve(coordinator, key, "single", *PIPELINE)
    assert refused.wait(60) == 2
    log = (coordinator.home / "serve-single.log").read_text()
    assert re.search(r"model needs [\d.]+ MB but \S+ has [\d.]+ MB \(cgroup v1 limit\)", log), log

    url = serve(coordinator, key, "auto", *PIPELINE)
    cluster = httpx.get(url + "/v1/cluster", timeout=10).json()
    assert cluster["strategy"] == "pp", cluster["reason"]
    assert len(cluster["plan"]["stages"]) == 3
    # every machine planned within its cgroup's limit, as a container sees it
    bounds = [cluster["coordinator"]["memory_bound"]] + [
        m["memory_bound"] for m in cluster["members"] if m["verified"]
    ]
    assert bounds == ["cgroup v1 limit"] * 3, bounds
    assert all(m["memory_total"] == MEMORY_LIMIT for m in cluster["members"] if m["verified"])
    assert {m["address"].split(":")[0] for m in cluster["members"] if m["verified"]} == {
        first.address, second.address,
    }  # found by multicast across the bridge, each at its own address
    sent = cluster["weights"]["sent_bytes"]
    assert {peer.split(":")[0] for peer in sent} == {first.address, second.address}
    # the agents never had the model: they hold only the shares they received
    assert not [p for m in (first, second) for p in (m.home / ".cache" / "tandem").glob("demo-*")]
    expected = single_outputs(model)
    assert answers(url) == expected
    finished = many_streams(url)
    assert len(finished) == STREAMS and set(finished) <= {"length", "stop"}, finished

    # tp over two: the coordinator and one agent; the rank receives only its share.
    coordinator.processes[-1].terminate()
    coordinator.processes[-1].wait(20)
    second.processes[-1].terminate()
    second.processes[-1].wait(20)
    url = serve(coordinator, key, "tp", *TP)
    cluster = httpx.get(url + "/v1/cluster", timeout=10).json()
    assert cluster["strategy"] == "tp" and cluster["world_size"] == 2, cluster["reason"]
    assert answers(url) == expected
    whole = sum(f.stat().st_size for f in model.iterdir() if f.is_file())
    received = sum(cluster["weights"]["sent_bytes"].values())
    assert 0 < received <= 0.6 * whole, (received, whole)  # its slices, not the model

    # A worker killed mid-stream: the stream ends with an error, the cluster plans again.
    [worker] = [m["worker_pid"] for m in cluster["members"] if m.get("worker_pid")]
    client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
    flowing, outcome = threading.Event(), []

    def stream() -> None:
        try:
            for chunk in client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "go on"}],
                max_tokens=2000, stream=True,
            ):
                if chunk.choices and chunk.choices[0].delta.content:
                    flowing.set()
            outcome.append("ended without an error")
        except APIError as error:
            outcome.append(f"error: {error}")

    thread = threading.Thread(target=stream)
    thread.start()
    assert flowing.wait(30)
    os.kill(worker, signal.SIGKILL)
    thread.join(30)
    assert outcome and outcome[0].startswith("error"), outcome
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        cluster = httpx.get(url + "/v1/cluster", timeout=10).json()
        if cluster["replans"] >= 1 and cluster["state"] == "ok":
            break
        time.sleep(0.5)
    assert cluster["replans"] >= 1 and cluster["state"] == "ok", cluster["last_replan_reason"]
    assert answers(url) == expected
    assert [machine.oom_kills() for machine in lab.machines] == [0, 0, 0]
