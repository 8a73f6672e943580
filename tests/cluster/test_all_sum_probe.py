"""The measured all_sum: two real collective_probe processes joined in an mlx ring on 127.0.0.1
(timing a demo model's tp layer too), a peer that never comes failing in time, and the survey
putting the measurement on the link."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from discovery.assignment_waits import AssignmentResult
from discovery.framing import free_port
from discovery.json_child import ChildNotReady, JsonChild
from discovery.link_probe import LinkMeasurement
from engines.cluster import all_sum_survey
from engines.cluster.all_sum_survey import AllSumProbe, GroupProbe
from engines.cluster.speed_survey import SpeedSurvey
from engines.model.info import inspect_model
from engines.model.tp_step_probe import MAX_PAIRS, MIN_PAIRS, has_tp_variant
from engines.tensor_parallel.collective_probe import MIN_ROUNDS
from errors import PeerError
from planner import NodeResources

pytestmark = pytest.mark.cluster

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PROBE = [sys.executable, "-m", "engines.tensor_parallel.collective_probe"]
CANNED_SPEED = {
    "layer": [[1, 0.001], [4, 0.002]],
    "head": [[1, 0.001], [4, 0.002]],
    "prefill_layer_s": 0.01,
    "prefill_chunk": 256,
}


def rank_payload(rank: int, hosts: list[list[str]], **extra: Any) -> dict[str, Any]:
    return {"rank": rank, "hosts": hosts, "hidden_size": 256, "rows": [1, 8], **extra}


def test_two_ranks_on_loopback_time_their_all_sums_and_a_tp_layer(demo_model_dir: Path) -> None:
    config = json.loads((demo_model_dir / "config.json").read_text())
    hosts = [[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]
    ranks = [JsonChild(PROBE, name=f"rank {r}", cwd=PROJECT_ROOT) for r in (0, 1)]
    try:
        for rank, child in enumerate(ranks):
            child.start(rank_payload(rank, hosts, config=config))
        ready = [child.wait_ready(60.0)["collective"] for child in ranks]
    finally:
        for child in ranks:
            child.stop(5.0, ask=child.close_stdin)
    for measured in ready:
        assert measured["ranks"] == 2 and MIN_ROUNDS <= measured["rounds"] <= 40
        assert [rows for rows, _ in measured["all_sum"]] == [1, 8]
        # a median all_sum on loopback: more than nothing, far less than a second
        assert all(0 < seconds < 0.2 for _, seconds in measured["all_sum"]), measured
    assert ready[0]["rounds"] == ready[1]["rounds"]  # they stopped on the same round
    for measured in ready:
        # the demo model sharded over both: a layer and the rest, all_sums included, by rows
        for key in ("tp_layer", "tp_rest", "tp_layer_cpu", "tp_rest_cpu"):
            assert [rows for rows, _ in measured[key]] == [1, 8], measured
            assert all(0 < seconds < 1.0 for _, seconds in measured[key]), measured
        assert all(MIN_PAIRS <= pairs <= MAX_PAIRS for pairs in measured["tp_pairs"])
    assert ready[0]["tp_pairs"] == ready[1]["tp_pairs"]  # rank 0 set the pairs for both


def test_only_a_model_mlx_lm_can_shard_has_a_tp_layer_to_time(demo_model_dir: Path) -> None:
    config = json.loads((demo_model_dir / "config.json").read_text())
    assert has_tp_variant(config)  # llama has Model.shard
    assert not has_tp_variant({**config, "model_type": "no-such-architecture"})


def test_a_rank_whose_peer_never_joins_ends_itself_in_time() -> None:
    hosts = [[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]
    started = time.monotonic()
    done = subprocess.run(
        PROBE, input=json.dumps(rank_payload(0, hosts, timeout_s=2)) + "\n",
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0 and "ready" not in done.stdout
    assert "joining the ring as rank 0 of 2" in done.stderr
    assert time.monotonic() - started < 2 + 15  # its timeout, plus starting Python and mlx


class LocalAgent:
    """A membership whose members run their roles as processes here: the collective probe for
    real, the speed probe canned; `absent` members accept an assignment and never start it,
    `broken` ones start it with a spec it cannot run (it fails at once, as a rank whose
    port is taken would)."""

    def __init__(self, absent: tuple[str, ...] = (), broken: tuple[str, ...] = ()) -> None:
        self.absent = absent
        self.broken = broken
        self.children: dict[str, JsonChild] = {}
        self.released: list[str] = []

    def measure_link(self, node_id: str) -> LinkMeasurement:
        return LinkMeasurement(50e-6, 125e6)

    def assign(self, node_id: str, role: str, payload: dict[str, Any]) -> str:
        if role == "collective_probe" and node_id not in self.absent:
            child = JsonChild(PROBE, name=f"{node_id} rank", cwd=PROJECT_ROOT)
            child.start({**payload, "hosts": "nowhere"} if node_id in self.broken else payload)
            self.children[node_id] = child
        return f"{node_id}/{role}"

    def wait_ready(self, assignment: str, timeout_s: float, stall_s: float | None = None):
        node_id, role = assignment.split("/")
        if role == "speed_probe":
            return AssignmentResult(node_id, assignment, {"speed": CANNED_SPEED})
        if node_id in self.absent:
            time.sleep(timeout_s)
            raise PeerError(f"node {node_id}'s worker was not ready within {timeout_s:g} s")
        try:
            message = self.children[node_id].wait_ready(timeout_s)
        except ChildNotReady as error:
            raise PeerError(str(error)) from None
        return AssignmentResult(node_id, assignment, message)

    def failure_of(self, assignment: str) -> str | None:
        """As Membership's: a rank that has ended before it was released has failed."""
        child = self.children.get(assignment.split("/")[0])
        return None if child is None or child.poll() is None else child.exit_description()

    def release(self, node_id: str, reason: str = "", wait_s: float = 0.0) -> bool:
        self.released.append(node_id)
        child = self.children.pop(node_id, None)
        if child is not None:
            child.stop(5.0, ask=child.close_stdin)
        return True


def test_a_member_that_never_joins_fails_the_probe_in_time_naming_both_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(all_sum_survey, "ALL_SUM_TIMEOUT_S", 3.0)
    agent = LocalAgent(absent=("b",))
    started = time.monotonic()
    with pytest.raises(PeerError) as failure:
        GroupProbe(agent, "b", "127.0.0.1", "127.0.0.1", AllSumProbe(256, (1, 8), True)).measure()
    message = str(failure.value)
    assert message.startswith("the all_sum probe between here (127.0.0.1:")
    assert " and b (127.0.0.1:" in message
    assert "no ready line within 3 s" in message and "joining the ring as rank 1" in message
    assert "the member: node b's worker was not ready" in message
    # starting Python and mlx here (not counted in the 3 s: under load it alone took more),
    # the wait, the member's answer, a SIGTERM to the rank here
    assert time.monotonic() - started < 15 + 3 + all_sum_survey.PEER_ANSWER_S + 3
    assert agent.released == ["b"]


def test_a_member_whose_rank_fails_ends_the_probe_at_once_not_at_its_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(all_sum_survey, "ALL_SUM_TIMEOUT_S", 30.0)
    agent = LocalAgent(broken=("b",))
    started = time.monotonic()
    with pytest.raises(PeerError) as failure:
        GroupProbe(agent, "b", "127.0.0.1", "127.0.0.1", AllSumProbe(256, (1, 8), True)).measure()
    message = str(failure.value)
    assert "stopped waiting: the member's rank failed" in message, message
    assert "the member: " in message and "collective probe failed" in message, message
    # starting Python and mlx for both ranks, then one look at the member: far from 30 s
    assert time.monotonic() - started < 12
    assert agent.released == ["b"]


def test_the_survey_puts_a_measured_all_sum_on_the_link_or_names_why_not(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # b times its all_sums and the demo model's tp layer within this; c's rank fails at once
    monkeypatch.setattr(all_sum_survey, "ALL_SUM_TIMEOUT_S", 12.0)
    survey = SpeedSurvey(LocalAgent(broken=("c",)), "a", coordinator_address="127.0.0.1")
    nodes = [NodeResources(n, address, 2**30, ("ring",)) for n, address in
             [("a", ""), ("b", "127.0.0.1"), ("c", "127.0.0.1")]]  # fmt: skip
    speeds = survey.for_plan(inspect_model(demo_model_dir), nodes, max_batch=4)
    measured, pinged = speeds.links["b"], speeds.links["c"]
    assert measured.all_sum is not None and [r for r, _ in measured.all_sum.points] == [1, 4]
    assert measured.tp_layer is not None and [r for r, _ in measured.tp_layer.points] == [1, 4]
    assert measured.tp_rest is not None and measured.tp_rest.at(1) > 0
    # each rank's own CPU time: this side's from its child here, the member's from its answer
    assert measured.tp_cpu is not None
    assert all(rank.layer.at(1) > 0 and rank.rest.at(1) > 0 for rank in measured.tp_cpu)
    assert pinged.all_sum is None and pinged.latency_s == 50e-6  # c stays on its pings
    status = survey.status()
    assert list(status["links"]["b"]["all_sum_ms"]) == [1, 4]
    assert "all_sum_ms" not in status["links"]["c"]
    assert list(status["links"]["b"]["tp_layer_ms"]) == [1, 4]
    assert [list(rank) for rank in status["links"]["b"]["tp_layer_cpu_ms"]] == [[1, 4], [1, 4]]
    assert "tp_layer_ms" not in status["links"]["c"]
    assert status["problems"]["c"].startswith("all_sum not measured: the all_sum probe between")
    lines = survey.describe()
    [link_b] = [line for line in lines if line.startswith("measured link to b:")]
    assert "; all_sum 2 ranks: " in link_b and " ms at 1 row, " in link_b, link_b
    assert " ms at 4 rows; a tp layer of 2 ranks, all_sums included: " in link_b, link_b
    assert " ms at 1 row (rest " in link_b and link_b.endswith(" ms)"), link_b
    assert "not measured c: all_sum not measured" in "\n".join(lines)
