"""`tandem serve --kv-bits 4` end to end: the plan and the engine say so (and the threshold,
mlx_lm.server's 5000 tokens by default), the prefix cache (its disk tier included) hits, and the
answers equal a cold quantized server's: a chat under the threshold stays in full precision."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.serve import LONG_SYSTEM, chat_two_turns, start_serve

pytestmark = pytest.mark.cluster

KEY = "tandem-" + "A" * 43


def test_serve_with_kv_bits_4_plans_serves_and_caches(demo_model_dir: Path, tmp_path: Path) -> None:
    base = ["--parallelism", "single", "--model-id", "demo", "--kv-bits", "4"]
    cold = start_serve(tmp_path, demo_model_dir, KEY, [*base, "--prefix-cache-bytes", "0"])
    try:
        cold_texts, cold_cached = chat_two_turns(cold, 16)
    finally:
        cold.stop()
    assert cold_cached == [0, 0]

    # a turn's entry overflows 64 KB of memory: every entry goes to disk
    disk = ["--prefix-cache-bytes", "64K", "--prefix-cache-disk-bytes", "1G"]
    server = start_serve(tmp_path, demo_model_dir, KEY, [*base, *disk], name="hot")
    try:
        cluster = server.cluster()
        texts, cached = chat_two_turns(server, 16)
        status = server.cluster()["engine"]
    finally:
        server.stop()
    plan = cluster["plan"]
    assert (plan["kv_bits"], plan["kv_bytes_per_token"]) == (4, 4 * 2 * 4 * (16 + 2 * 4))
    assert (plan["quantized_kv_start"], status["quantized_kv_start"]) == (5000, 5000)
    assert plan["full_kv_bytes_per_token"] == 4 * 2 * 4 * 32 * 4  # float32 under the threshold
    assert status["kv_bits"] == 4 and status["prefix_cache"]["disk_hits"] >= 1
    assert cached[1] > len(LONG_SYSTEM) // 10 and texts == cold_texts
    assert list((tmp_path / "cache" / "prefix-cache").rglob("single-kv4/*.safetensors"))
