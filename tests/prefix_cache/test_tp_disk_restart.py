"""tp's disk tier across restarts: a group restarted with the same plan lists the entries every
rank holds and starts from them; an entry one rank lacks is a miss with the right answer
(at start-up or later); a changed plan reads nothing (here: the KV quantization; another
world size or model looks in another directory, `tier_root`)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.single.engine import SingleEngine
from tests.helpers.engine import run_one
from tests.helpers.tensor_parallel import LOAD_TIMEOUT_S, Cluster, close_cluster, open_cluster

SYSTEM = "You are a careful assistant. Answer in full sentences and cite what you use. " * 12
SHARES = ("tp-0of2", "tp-1of2")
TOKENS = 12


@dataclass(frozen=True)
class Written:
    """A cache directory a tp=2 group left one entry in (the first turn), and the answers."""

    cache_dir: Path
    second: tuple[int, ...]  # the follow-up prompt: the first turn's entry is its prefix
    first_length: int
    cold: list[int]  # a cold single engine's answer to it


def share_files(cache_dir: Path, share: str, suffix: str) -> list[Path]:
    return list(cache_dir.rglob(f"{share}/*.{suffix}"))


def disk_options(cache_dir: Path, **more: Any) -> dict[str, Any]:
    return {
        "prefix_cache_bytes": 1 << 28, "prefix_cache_disk_bytes": 1 << 28,
        "prefix_cache_dir": str(cache_dir), **more,
    }  # fmt: skip


def started(model: Path, cache_dir: Path, **more: Any) -> tuple[Cluster, EngineRunner]:
    cluster = open_cluster(model, spec_options=disk_options(cache_dir, **more))
    runner = EngineRunner(cluster.engine, max_batch=4)
    runner.start(LOAD_TIMEOUT_S)
    return cluster, runner


def stopped(cluster: Cluster, runner: EngineRunner) -> None:
    runner.close()  # closes the engine: the ranks finish their disk writes and exit
    for rank in cluster.ranks:
        rank.wait(30)
    close_cluster(cluster)


def spill_all(runner: EngineRunner, cache_dir: Path) -> None:
    """Memory pressure: every entry goes to disk; wait until every rank wrote its shard."""
    runner.request_prefix_eviction(0.0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
        share_files(cache_dir, share, "json") for share in SHARES
    ):
        time.sleep(0.05)
    assert all(share_files(cache_dir, share, "json") for share in SHARES)


@pytest.fixture(scope="module")
def written(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Written:
    cache_dir = tmp_path_factory.mktemp("tp-disk") / "prefix-cache"
    cluster, runner = started(demo_model_dir, cache_dir)
    try:
        tokenizer = cluster.engine.tokenizer
        first = tuple(tokenizer.encode(SYSTEM + " Question one: what is a fox?"))
        turn_one = run_one(runner, GenerationRequest("t1", first, TOKENS))
        spill_all(runner, cache_dir)
    finally:
        stopped(cluster, runner)
    second = first + tuple(turn_one.tokens) + tuple(tokenizer.encode(" Question two?"))
    cold_runner = EngineRunner(SingleEngine(demo_model_dir), max_batch=4)
    cold_runner.start(LOAD_TIMEOUT_S)
    try:
        cold = run_one(cold_runner, GenerationRequest("cold", second, TOKENS)).tokens
    finally:
        cold_runner.close()
    return Written(cache_dir, second, len(first), cold)


@pytest.fixture
def cache_copy(written: Written, tmp_path: Path) -> Iterator[Path]:
    """This test's own copy of the written directory (a test may damage it)."""
    copy = tmp_path / "prefix-cache"
    shutil.copytree(written.cache_dir, copy)
    yield copy


def test_a_restarted_group_starts_from_its_entry_on_disk_and_answers_exactly(
    demo_model_dir: Path, written: Written, cache_copy: Path
):
    cluster, runner = started(demo_model_dir, cache_copy)
    try:
        assert cluster.engine.info().detail["prefix_cache"]["disk_entries"] == 1
        turn_two = run_one(runner, GenerationRequest("t2", written.second, TOKENS))
        snapshot = cluster.engine.info().detail["prefix_cache"]
        prefilled = cluster.engine.info().detail["prefilled_tokens"]
        assert cluster.engine.healthy(), cluster.lost
    finally:
        stopped(cluster, runner)
    assert turn_two.cached_tokens >= written.first_length
    assert snapshot["disk_hits"] == 1 and snapshot["disk_failures"] == 0
    assert prefilled == len(written.second) - turn_two.cached_tokens
    assert turn_two.tokens == written.cold


def test_an_entry_one_rank_lacks_at_start_up_is_listed_by_none(
    demo_model_dir: Path, written: Written, cache_copy: Path
):
    (meta,) = share_files(cache_copy, "tp-1of2", "json")
    meta.unlink()  # rank 1's shard is gone (a torn write, a wiped disk)
    cluster, runner = started(demo_model_dir, cache_copy)
    try:
        assert cluster.engine.info().detail["prefix_cache"]["disk_entries"] == 0
        turn_two = run_one(runner, GenerationRequest("t2", written.second, TOKENS))
        assert cluster.engine.healthy(), cluster.lost
    finally:
        stopped(cluster, runner)
    assert turn_two.cached_tokens == 0 and turn_two.tokens == written.cold
    assert not share_files(cache_copy, "tp-0of2", "json")  # rank 0 removed its useless shard


def test_an_entry_one_rank_loses_while_running_is_a_miss_not_a_failed_group(
    demo_model_dir: Path, written: Written, cache_copy: Path
):
    cluster, runner = started(demo_model_dir, cache_copy)
    try:
        assert cluster.engine.info().detail["prefix_cache"]["disk_entries"] == 1
        for data in share_files(cache_copy, "tp-1of2", "safetensors"):
            data.write_bytes(b"damaged after the group listed it")
        turn_two = run_one(runner, GenerationRequest("t2", written.second, TOKENS))
        snapshot = cluster.engine.info().detail["prefix_cache"]
        prefilled = cluster.engine.info().detail["prefilled_tokens"]
        assert cluster.engine.healthy(), cluster.lost
    finally:
        stopped(cluster, runner)
    assert turn_two.cached_tokens == 0 and turn_two.tokens == written.cold
    assert prefilled == len(written.second)  # every rank prefilled the whole prompt
    assert snapshot["disk_failures"] == 1


def test_a_changed_plan_reads_none_of_the_entries(
    demo_model_dir: Path, written: Written, cache_copy: Path
):
    cluster, runner = started(demo_model_dir, cache_copy, kv_bits=8, quantized_kv_start=0)
    try:
        assert cluster.engine.info().detail["prefix_cache"]["disk_entries"] == 0
        turn_two = run_one(runner, GenerationRequest("t2", written.second, TOKENS))
    finally:
        stopped(cluster, runner)
    assert turn_two.cached_tokens == 0
