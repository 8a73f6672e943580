"""A multi-turn chat through the openai client hits the prefix cache of a real `tandem serve`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cluster import AgentPool
from tests.helpers.serve import LONG_SYSTEM, chat_two_turns, start_serve

pytestmark = pytest.mark.cluster

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cold_texts(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """What one machine with the cache off answers: tp and pp answer the same (greedy)."""
    tmp = tmp_path_factory.mktemp("cold")
    args = ["--parallelism", "single", "--model-id", "demo", "--prefix-cache-bytes", "0"]
    server = start_serve(tmp, demo_model_dir, "tandem-" + "A" * 43, args, name="cold")
    try:
        texts, cached = chat_two_turns(server, MAX_TOKENS)
    finally:
        server.stop()
    assert cached == [0, 0]
    return texts


@pytest.mark.parametrize("strategy", ["single", "tp", "pp"])
def test_the_second_turn_hits_the_cache_and_says_what_a_cold_server_says(
    strategy: str, demo_model_dir: Path, pool: AgentPool, tmp_path: Path, cold_texts: list[str]
) -> None:
    args = ["--parallelism", strategy, "--model-id", "demo"]
    if strategy != "single":
        pool.start("peer", real_roles=True)
        args += ["--collective", "ring"]
    server = start_serve(tmp_path, demo_model_dir, pool.cluster_key, args, name="hot")
    try:
        cluster = server.cluster()
        assert cluster["strategy"] == strategy
        assert cluster["plan"]["prefix_cache_bytes"] > 0  # auto: derived from memory left
        texts, cached = chat_two_turns(server, MAX_TOKENS)
        snapshot = server.cluster()["engine"]["prefix_cache"]
    finally:
        server.stop()
    assert cached[0] == 0 and cached[1] > len(LONG_SYSTEM) // 8  # most of turn one
    assert texts == cold_texts
    assert snapshot["hits"] == 1 and snapshot["entries"] >= 1


def test_entries_on_disk_serve_the_next_turn_and_the_next_server(
    demo_model_dir: Path, tmp_path: Path, cold_texts: list[str]
) -> None:
    """A memory tier too small for any entry: every entry is on disk, and a follow-up turn
    still starts from it; after SIGTERM (a clean shutdown) a new server finds them again."""
    args = ["--parallelism", "single", "--model-id", "demo", "--prefix-cache-bytes", "1M"]
    args += ["--prefix-cache-disk-bytes", "1G"]
    for run in ("first", "restarted"):
        server = start_serve(tmp_path, demo_model_dir, "tandem-" + "A" * 43, args, name=run)
        try:
            texts, cached = chat_two_turns(server, MAX_TOKENS)
            status = server.cluster()["engine"]["prefix_cache"]
        finally:
            code = server.stop()
        assert code == 0, server.log_text()[-2000:]  # SIGTERM: a clean shutdown, not a kill
        assert texts == cold_texts
        assert cached[1] > len(LONG_SYSTEM) // 10  # the follow-up started from the first turn
        assert status["entries"] == 0 and status["disk_entries"] >= 1
        assert list((tmp_path / "cache" / "prefix-cache").rglob("*.safetensors"))
    assert cached[0] > len(LONG_SYSTEM) // 10  # the restarted server's first turn hit the disk
    assert status["disk_hits"] == 2
