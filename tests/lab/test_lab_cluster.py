"""Three separate lab machines: agents found by multicast zeroconf across the bridge, the model
sent to agents that lack it (a stage its layers, a tp rank its slices), pp over three and tp
over two answering what single answers, and a worker killed mid-stream turning into an error
event and a re-plan."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import APIError, OpenAI

from discovery.cluster_key import format_key, generate_key
from tests.helpers.reference import MAX_TOKENS, PROMPTS, single_outputs
from tests.lab.machines import Lab, Machine, lab_unavailable

pytestmark = [
    pytest.mark.lab,
    pytest.mark.skipif(bool(lab_unavailable()), reason=lab_unavailable() or "lab available"),
]

PORT = 8000
READY_S = 90.0
PYTHON = [sys.executable, "-m", "cli.main"]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab(3) as built:
        yield built


def join(machine: Machine, key: str) -> None:
    machine.popen(
        [*PYTHON, "join", "--cluster-key", key, "--interface", machine.address,
         "--heartbeat-interval", "0.5", "--lost-after", "3"],
        log=machine.home / "join.log", cwd=REPO,
    )


def serve(machine: Machine, key: str, parallelism: str, *extra: str) -> str:
    machine.popen(
        [*PYTHON, "serve", "--parallelism", parallelism, "--collective", "ring",
         "--interface", machine.address, "--host", machine.address, "--port", str(PORT),
         "--cluster-key", key, "--model-id", "demo", "--lost-after", "3",
         "--discovery-timeout", "3", *extra],
        log=machine.home / f"serve-{parallelism}.log", cwd=REPO,
    )
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


def answers(url: str) -> list[str]:
    client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=60)
    return [
        client.completions.create(model="demo", prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        .choices[0].text
        for p in PROMPTS
    ]


def demo_model_of(machine: Machine) -> Path:
    [model] = (machine.home / ".cache" / "tandem").glob("demo-*")
    return model


def test_three_machines_find_each_other_receive_the_model_and_answer_as_one(lab: Lab) -> None:
    key = format_key(generate_key())
    coordinator, first, second = lab.machines
    join(first, key)
    join(second, key)

    url = serve(coordinator, key, "pp")
    cluster = httpx.get(url + "/v1/cluster", timeout=10).json()
    assert cluster["strategy"] == "pp", cluster["reason"]
    assert len(cluster["plan"]["stages"]) == 3
    assert {m["address"].split(":")[0] for m in cluster["members"] if m["verified"]} == {
        first.address, second.address,
    }  # found by multicast across the bridge, each at its own address
    sent = cluster["weights"]["sent_bytes"]
    assert {peer.split(":")[0] for peer in sent} == {first.address, second.address}
    # the agents never had the model: they hold only the shares they received
    assert not [p for m in (first, second) for p in (m.home / ".cache" / "tandem").glob("demo-*")]
    expected = single_outputs(demo_model_of(coordinator))
    assert answers(url) == expected

    # tp over two: the coordinator and one agent; the rank receives only its share.
    coordinator.processes[-1].terminate()
    coordinator.processes[-1].wait(20)
    second.processes[-1].terminate()
    second.processes[-1].wait(20)
    url = serve(coordinator, key, "tp")
    cluster = httpx.get(url + "/v1/cluster", timeout=10).json()
    assert cluster["strategy"] == "tp" and cluster["world_size"] == 2, cluster["reason"]
    assert answers(url) == expected
    model = demo_model_of(coordinator)
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
