"""The dashboard's views and the re-plan history, rendered from status bodies as the
supervisor and the engines report them."""

from __future__ import annotations

import pytest

from engines.api.dashboard_view import render_members, render_predictions, render_summary
from engines.cluster.replan_history import ReplanHistory, reason_kind
from engines.cluster.supervisor import predicted_status
from planner.speed import Curve, Prediction


def test_members_show_role_memory_tier_and_heartbeat() -> None:
    status = {
        "strategy": "pp",
        "plan": {
            "stages": [
                {"node_id": "coord", "layers": [0, 2]},
                {"node_id": "m1", "layers": [2, 4]},
            ],
            "fits": [{"node_id": "m1", "need_bytes": 3 * 2**30, "available_bytes": 4 * 2**30}],
        },
        "coordinator": {"node_id": "coord", "memory_available": 2**33, "backends": ["ring"]},
        "members": [
            {
                "node_id": "m1",
                "state": "connected",
                "memory_available": 4 * 2**30,
                "memory_tier": "tight",
                "last_heartbeat_age_s": 0.4,
                "worker_state": "ready",
                "transfer": {"done_bytes": 2**30, "total_bytes": 4 * 2**30, "age_s": 0.5},
            }
        ],
    }
    html = render_members(status)
    assert "pp stage 0: layers 0–1" in html and "pp stage 1: layers 2–3" in html
    assert "3.00 GiB of 4.00 GiB" in html and "width:75.0%" in html
    assert "tight" in html and "0.4 s ago" in html
    assert "model transfer" in html and "25% · 1.00 GiB of 4.00 GiB" in html
    assert html.count("model transfer") == 1  # only the agent that receives the model


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        ("member m2 lost: its worker failed: exit 1", "worker_failed"),
        ("member m2 lost: no heartbeat for 5.0 s", "member_lost"),
        ("pp engine became unhealthy", "engine_unhealthy"),
        ("membership changed: 3 verified node(s) now", "membership_changed"),
        ("the moon is full", "other"),
    ],
)
def test_replan_reasons_fall_into_few_kinds(reason: str, kind: str) -> None:
    assert reason_kind(reason) == kind


def test_replan_history_counts_and_fills_in_the_new_strategy() -> None:
    history = ReplanHistory(length=2)
    history.record("member a lost: closed")
    history.record("member b lost: its worker failed: boom")
    history.served("single")
    history.record("pp engine became unhealthy")
    newest, older = history.describe()
    assert newest["kind"] == "engine_unhealthy" and newest["strategy"] is None
    assert older["strategy"] == "single" and older["outage_s"] >= 0
    assert history.counts() == {"member_lost": 1, "worker_failed": 1, "engine_unhealthy": 1}


def test_the_dashboard_summary_shows_the_prefix_cache_in_memory_and_on_disk() -> None:
    cache = {"hits": 3, "misses": 1, "bytes": 5 << 20, "disk_max_bytes": 1 << 30}
    cache["disk_bytes"] = 40 << 20
    html = render_summary({"engine": {"prefix_cache": cache}}, {"status": "ok"}, "demo")
    assert "3/4 hits, 5 MB + 40 MB on disk" in html
    without_disk = {**cache, "disk_max_bytes": 0}
    html = render_summary({"engine": {"prefix_cache": without_disk}}, {"status": "ok"}, "demo")
    assert "3/4 hits, 5 MB<" in html


def test_the_dashboard_shows_every_prediction_and_what_the_serving_plan_does() -> None:
    tp = Prediction("tp", ("c", "a"), 25.6, 8, 121.1, 1.6, "compute 32.3 ms")
    single = Prediction("single", ("c",), 16.2, 8, 50.7, 2.8, "16 layers x 3.6 ms")
    status = {
        "plan": {"predictions": [tp.to_dict(), single.to_dict()]},
        "served": {"requests": 4, "decode_tps_per_stream": 24.2},
        "speeds": {
            "nodes": {"c": {"layer_ms": {1: 3.6}}},
            "links": {
                "a": {
                    "latency_us": 90.0,
                    "all_sum_ms": {1: 0.48, 8: 0.61},
                    "tp_layer_ms": {1: 1.31, 8: 2.2},
                    "tp_rest_ms": {1: 2.5, 8: 6.0},
                }
            },
        },
    }
    html = render_predictions(status)
    assert html.index("tp=2 (serving)") < html.index("single")
    assert "25.6" in html and "24.2 (4 requests)" in html and "16.2" in html
    assert "link to a: 90.0 us" in html
    assert "all_sum 2 ranks {1: 0.48, 8: 0.61} ms by rows" in html
    assert "a tp layer of 2 ranks, all_sums included, {1: 1.31, 8: 2.2} ms by rows" in html
    assert "(the rest {1: 2.5, 8: 6.0})" in html
    assert "not measured" in render_predictions({"plan": {"predictions": []}})
    assert "predicted -> served" not in html  # tp's prediction has no segments


def test_the_dashboard_sets_a_pipelines_stages_predicted_beside_served() -> None:
    segments = (("stage0", 0.0181), ("stage1", 0.0194), ("transit", 0.0002))
    pp = Prediction("pp", ("c", "a"), 26.4, 8, 96.5, 2.4, "slowest stage a", segments)
    served = {"requests": 3, "decode_tps_per_stream": 19.0}
    status = {"plan": {"predictions": [pp.to_dict()]}, "served": served}
    html = render_predictions(status)
    assert "stage0 on c 18.1 -&gt; not served yet; stage1 on a 19.4 -&gt; not served" in html
    served["segments_ms"] = {"stage0": 24.6, "stage1": 21.9, "transit": 1.2}
    html = render_predictions(status)
    assert "stage0 on c 18.1 -&gt; 24.6; stage1 on a 19.4 -&gt; 21.9; transit 0.2 -&gt; 1.2" in html


def test_the_serving_prediction_at_the_speculation_its_engine_measured() -> None:
    """Once the engine has drafted, /v1/cluster's `predicted` adds the 1-stream speed at its
    counts: 10 lone passes fed 3 positions each on average (40 -> 50 ms a pass) and yielded
    2 tokens, so 40 tok/s; the dashboard sets it beside the plain prediction."""
    pass_s = Curve(((1, 0.04), (5, 0.06)))
    pp = Prediction("pp", ("c", "a"), 25.0, 8, 96.5, 2.4, "slowest stage a", pass_s=pass_s)
    undrafted = {"speculation": {"most_drafted": 8, "drafted": 0, "accepted": 0, "steps": 4}}
    assert predicted_status(pp, undrafted) == predicted_status(pp, None) == pp.to_dict()
    counts = {"most_drafted": 8, "drafted": 20, "accepted": 10, "steps": 10}
    predicted = predicted_status(pp, {"speculation": counts})
    assert predicted is not None
    assert predicted["speculating"] == {
        "decode_tps": 40.0,
        "tokens_per_pass": 2.0,
        "positions_per_pass": 3.0,
        "passes": 10,
    }
    status = {"plan": {"predictions": [pp.to_dict()]}, "predicted": predicted, "served": {}}
    assert "25.0; 40.0 speculating (2.00 tokens a pass)</td>" in render_predictions(status)


def test_a_model_alone_on_an_agent_shows_the_coordinator_relaying() -> None:
    status = {
        "strategy": "single",
        "relayed": True,
        "plan": {
            "stages": [
                {"node_id": "coord", "layers": [0, 0]},
                {"node_id": "m1", "layers": [0, 4]},
            ],
            "fits": [
                {"node_id": "coord", "need_bytes": 2**20, "available_bytes": 2**33},
                {"node_id": "m1", "need_bytes": 2**30, "available_bytes": 4 * 2**30},
            ],
        },
        "coordinator": {"node_id": "coord", "memory_available": 2**33},
        "members": [{"node_id": "m1", "state": "connected", "memory_available": 4 * 2**30}],
    }
    html = render_members(status)
    assert html.index("single: relays (embedding)") < html.index("single: every layer")
    assert html.count("every layer") == 1
