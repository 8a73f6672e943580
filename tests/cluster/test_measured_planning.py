"""The measured planner end to end: the speed probe on a real model's architecture, link pings
over a real control channel, and `tandem serve` with an agent choosing by measurement."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from discovery.cluster_key import format_key, generate_key
from engines.cluster.speed_survey import node_speed, probe_spec, wants_measuring
from engines.model.info import inspect_model
from engines.model.speed_probe import measure
from planner import NodeResources
from planner.measured import LEAVING_SINGLE_MARGIN, MORE_MACHINES_MARGIN
from tests.helpers.cluster import AgentPool
from tests.helpers.serve import ServeProcess, start_serve

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]


def test_the_probe_measures_a_layer_its_shard_and_the_head(demo_model_dir: Path) -> None:
    config = json.loads((demo_model_dir / "config.json").read_text())
    measured = measure(config, rows=(1, 4), tp_sizes=(2,), prefill_chunk=64)
    speed = node_speed("here", measured)  # the planner accepts it: positive, ascending rows
    assert [rows for rows, _ in speed.layer.points] == [1, 4]
    assert speed.shard(2) is not None and speed.shard(4) is None
    assert 0 < speed.layer.at(1) < 1.0 and 0 < speed.prefill_layer_s < 5.0
    assert measured["probe_s"] < 60


def test_tp_shards_are_measured_only_when_tp_may_be_planned(demo_model_dir: Path) -> None:
    facts = inspect_model(demo_model_dir)
    assert probe_spec(facts, 2, 4, float32=True).tp_sizes == (2,)
    assert probe_spec(facts, 2, 4, float32=True, tp=False).tp_sizes == ()
    assert probe_spec(facts, 1, 4, float32=True).tp_sizes == ()  # alone


@pytest.mark.parametrize(
    ("choice", "addresses", "expected"),
    [
        ("auto", ["127.0.0.1", "127.0.0.1"], False),  # every member shares this machine
        ("auto", ["198.18.0.1", "198.18.0.2"], True),
        ("on", ["127.0.0.1", "127.0.0.1"], True),
        ("off", ["198.18.0.1", "198.18.0.2"], False),
        ("auto", ["198.18.0.1"], False),  # alone: nothing to choose between
        ("on", ["198.18.0.1"], True),  # ...but asked: the plan shows its prediction
        ("off", ["198.18.0.1"], False),
    ],
)
def test_when_speeds_are_measured(choice: str, addresses: list[str], expected: bool) -> None:
    nodes = [NodeResources(f"n{i}", a, 2**30, ("ring",)) for i, a in enumerate(addresses)]
    assert wants_measuring(choice, nodes) is expected


def test_serve_measures_its_agent_and_serves_the_fastest_predicted_plan(
    demo_model_dir: Path, pool: AgentPool, servers: list[ServeProcess], tmp_path: Path
) -> None:
    pool.start("measured", real_roles=True)
    server = start_serve(
        tmp_path, demo_model_dir, pool.cluster_key,
        ["--parallelism", "auto", "--model-id", "demo", "--measure-speeds", "on",
         "--collective", "ring", "--max-batch", "4"],
    )  # fmt: skip
    servers.append(server)
    cluster = server.cluster()
    speeds = cluster["speeds"]
    assert len(speeds["nodes"]) == 2 and len(speeds["links"]) == 1, speeds
    assert not speeds["problems"]
    # how long measuring both took, whole (probes, link, all_sum and tp group), within bounds
    assert 0 < speeds["measured_in_s"] < 120, speeds
    [link] = speeds["links"].values()
    assert link["latency_us"] > 0 and link["mbit_per_s"] > 0
    # tp is possible, so the all_sum it would run was measured too, at 1 row and a full batch,
    # and a tp layer of the model as the 2-rank group runs it
    assert list(link["all_sum_ms"]) == ["1", "4"] and min(link["all_sum_ms"].values()) > 0
    assert list(link["tp_layer_ms"]) == ["1", "4"] and min(link["tp_layer_ms"].values()) > 0
    assert list(link["tp_rest_ms"]) == ["1", "4"]
    plan = cluster["plan"]
    labels = [p["label"] for p in plan["predictions"]]
    relay = f"single on {pool.agents[0].node_id}, relayed"  # alone on the agent
    assert sorted(labels) == ["pp=2", "single", relay, "tp=2"], labels
    tp = next(p for p in plan["predictions"] if p["label"] == "tp=2")
    # the group measured whole prices tp: 4 layers x its layer, not the shard plus all_sums
    dominant = tp["dominant"]
    assert dominant.startswith("4 layers x ") and "measured as a 2-rank group" in dominant, tp
    chosen = plan["predictions"][0]
    fastest = max(plan["predictions"], key=lambda p: p["decode_tps"])
    if chosen == fastest:
        assert cluster["reason"].startswith(f"auto -> {chosen['label']}: fastest of 4 measured")
    else:  # a plan on fewer machines within the margin of the fastest
        assert len(chosen["nodes"]) < len(fastest["nodes"])
        single = chosen["strategy"] == "single"
        margin = LEAVING_SINGLE_MARGIN if single else MORE_MACHINES_MARGIN
        assert fastest["decode_tps"] <= chosen["decode_tps"] * (1 + margin)
        assert "faster on more machines" in cluster["reason"]
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60)
    reply = client.completions.create(model="demo", prompt="Hi", max_tokens=4, temperature=0)
    assert reply.choices[0].text is not None and reply.usage.completion_tokens == 4
    after = server.cluster()  # what the plan was predicted to do, beside what it did
    assert after["predicted"] == chosen
    assert after["served"]["requests"] == 1 and after["served"]["decode_tps_per_stream"] > 0


def test_tandem_plan_prints_the_measured_link_and_its_all_sum(
    demo_model_dir: Path, pool: AgentPool, tmp_path: Path
) -> None:
    pool.start("planned", real_roles=True)
    command = [
        sys.executable, "-m", "cli.main", "plan", "--model", str(demo_model_dir),
        "--cluster-key", pool.cluster_key, "--interface", "127.0.0.1", "--discovery-timeout", "3",
        "--state-dir", str(tmp_path / "state"), "--measure-speeds", "on", "--max-batch", "4",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    [link] = [line for line in done.stdout.splitlines() if line.startswith("measured link to ")]
    assert "; all_sum 2 ranks: " in link and " ms at 1 row, " in link, link
    assert " ms at 4 rows; a tp layer of 2 ranks, all_sums included: " in link, link
    assert link.endswith(" ms)"), link
    assert "not measured" not in done.stdout, done.stdout
    assert re.search(r"^measuring took \d+(\.\d)? s$", done.stdout, re.MULTILINE), done.stdout


def test_single_alone_measured_on_request_shows_its_prediction_beside_what_it_serves(
    demo_model_dir: Path, servers: list[ServeProcess], tmp_path: Path
) -> None:
    server = start_serve(
        tmp_path, demo_model_dir, format_key(generate_key()),
        ["--parallelism", "single", "--model-id", "demo", "--measure-speeds", "on",
         "--max-batch", "4"],
    )  # fmt: skip
    servers.append(server)
    cluster = server.cluster()
    assert list(cluster["speeds"]["nodes"]) == [cluster["plan"]["ranks"][0]]
    assert not cluster["speeds"]["links"] and not cluster["speeds"]["problems"]
    assert cluster["speeds"]["measured_in_s"] > 0
    [prediction] = cluster["plan"]["predictions"]
    assert prediction["label"] == "single" and prediction["decode_tps"] > 0
    layers = json.loads((demo_model_dir / "config.json").read_text())["num_hidden_layers"]
    assert prediction["dominant"].startswith(f"{layers} layers x "), prediction
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60)
    reply = client.completions.create(model="demo", prompt="Hi", max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4
    after = server.cluster()
    assert after["predicted"] == prediction
    assert after["served"]["requests"] == 1 and after["served"]["decode_tps_per_stream"] > 0


def test_a_measured_pipeline_sets_each_stage_predicted_beside_served(
    demo_model_dir: Path, pool: AgentPool, servers: list[ServeProcess], tmp_path: Path
) -> None:
    """Where a prediction is off: a 1-stream token's stages and hops, predicted and served."""
    pool.start("staged", real_roles=True)
    server = start_serve(
        tmp_path, demo_model_dir, pool.cluster_key,
        ["--parallelism", "pp", "--model-id", "demo", "--measure-speeds", "on",
         "--max-batch", "4"],
    )  # fmt: skip
    servers.append(server)
    cluster = server.cluster()
    # pp was asked for, and a re-plan keeps it: no tp shard or all_sum was measured for it
    [link] = cluster["speeds"]["links"].values()
    assert "all_sum_ms" not in link and "tp_layer_ms" not in link, link
    prediction = cluster["predicted"]
    assert prediction["label"] == "pp=2", prediction
    assert list(prediction["segments_ms"]) == ["stage0", "stage1", "transit"], prediction
    assert min(prediction["segments_ms"].values()) > 0
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60)
    reply = client.completions.create(model="demo", prompt="Hi", max_tokens=6, temperature=0)
    assert reply.usage.completion_tokens == 6
    served = server.cluster()["served"]["segments_ms"]
    # the decode steps of that one stream, each stage's layers and the hops between them
    assert {"stage0", "stage1", "transit"} <= set(served), served
    assert served["stage0"] > 0 and served["stage1"] > 0
