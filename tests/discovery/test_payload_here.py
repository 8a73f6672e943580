"""An agent adds to an assignment only what its own machine knows: where models and the
prefix cache's disk tier live there."""

from __future__ import annotations

from pathlib import Path

from discovery.coordinator_session import payload_here


def test_a_disk_tier_budget_gets_this_machines_directory_in_the_engine_options():
    payload = {"layers": [2, 4], "options": {"kv_bits": 8, "prefix_cache_disk_bytes": 1 << 30}}
    here = payload_here(payload, Path("/agent/cache"), None)
    assert here["options"] == {
        "kv_bits": 8, "prefix_cache_disk_bytes": 1 << 30,
        "prefix_cache_dir": "/agent/cache/prefix-cache",
    }  # fmt: skip
    assert "prefix_cache_dir" not in payload["options"]  # the coordinator's copy is untouched


def test_without_a_budget_or_a_cache_nothing_is_added():
    payload = {"options": {"prefix_cache_disk_bytes": 0}}
    assert payload_here(payload, Path("/agent/cache"), None) == payload
    assert payload_here({"options": {"prefix_cache_disk_bytes": 1}}, None, None) == {
        "options": {"prefix_cache_disk_bytes": 1}
    }


def test_a_weights_offer_learns_where_this_machine_keeps_models():
    here = payload_here({"weights": {"host": "h", "port": 1}}, Path("/c"), 5)
    assert here["weights"] == {"host": "h", "port": 1, "cache_dir": "/c/models", "disk_limit": 5}
