"""The prefix cache's disk tier on 2 real stages: every stage spills its layers' share of an
evicted entry to its own directory, a hit reads every share back and equals a cold engine, a
torn or corrupt share on any stage is a miss (still the right answer), and the disk budget
holds over every stage's files."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from discovery.cluster_key import generate_key
from engines.core.runner import EngineRunner
from engines.pipeline.engine import EncryptedPipelineEngine
from engines.pipeline.stage_worker import StageProcess
from engines.prefix_cache.disk_tier import tier_root
from engines.single.engine import SingleEngine
from planner import allocate_layers
from tests.helpers.pipeline import HOST, status, stop_workers
from tests.helpers.prefix_turns import SYSTEM, Turn, ask

pytestmark = pytest.mark.cluster

RANGES = allocate_layers(4, [8, 8])  # [0, 2) here, [2, 4) on the stage worker
SHARES = ("layers-0-2", "layers-2-4")
DISK_BYTES = 1 << 28


@dataclass
class Spilling:
    """2 stages whose memory tier keeps nothing (every entry goes to disk), and a cold twin."""

    engine: EncryptedPipelineEngine
    runner: EngineRunner
    cold: EngineRunner
    directories: tuple[Path, Path]  # each stage's share of the disk tier: stage 0, stage 1
    worker: StageProcess

    def close(self) -> None:
        self.runner.close()
        self.cold.close()
        stop_workers([self.worker])

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.engine.tokenizer.encode(text))

    def files(self, stage: int, suffix: str = "json") -> list[Path]:
        return sorted(self.directories[stage].glob(f"*.{suffix}"))

    def wait_written(self, count: int) -> None:
        """Until every stage has `count` entries' files, both kinds (written and deleted in the
        background)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            kinds = ("json", "safetensors")
            if all(len(self.files(stage, kind)) == count for stage in (0, 1) for kind in kinds):
                return
            time.sleep(0.05)
        raise AssertionError(f"stage files: {[self.files(stage) for stage in (0, 1)]}")

    def snapshot(self) -> dict[str, int]:
        return self.engine.info().detail["prefix_cache"]


def start_spilling(model: Path, root: Path, disk_bytes: int) -> Spilling:
    key = generate_key()
    machines = (root / "coordinator", root / "stage-1")  # each machine's cache directory
    listener = socket.create_server((HOST, 0))
    spec = {
        "model_path": str(model), "layers": [RANGES[1].start, RANGES[1].stop], "is_last": True,
        "listen_host": HOST, "next_host": HOST, "next_port": listener.getsockname()[1],
        "cluster_key": key.hex(), "prefix_cache_disk_bytes": disk_bytes,
        "prefix_cache_dir": str(machines[1]),
    }  # fmt: skip
    worker = StageProcess.start(spec, ready_timeout_s=60)
    stages = [{"host": HOST, "port": worker.port, "layers": [RANGES[1].start, RANGES[1].stop]}]
    engine = EncryptedPipelineEngine(
        model, RANGES[0], stages, HOST, key, return_listener=listener, prefill_chunk=16,
        prefix_cache_bytes=1024, prefix_cache_disk_bytes=disk_bytes,
        prefix_cache_dir=machines[0],
    )  # fmt: skip
    runner = EngineRunner(engine)
    cold = EngineRunner(SingleEngine(model))
    runner.start(load_timeout_s=60)
    cold.start(load_timeout_s=60)
    directories = (
        tier_root(machines[0], model, SHARES[0]),
        tier_root(machines[1], model, SHARES[1]),
    )
    return Spilling(engine, runner, cold, directories, worker)


@pytest.fixture
def spilling(demo_model_dir: Path, tmp_path: Path) -> Iterator[Spilling]:
    setup = start_spilling(demo_model_dir, tmp_path, DISK_BYTES)
    try:
        yield setup
    finally:
        setup.close()


def assert_exact(spilling: Spilling, prompt: tuple[int, ...], turn: Turn) -> None:
    cold = ask(spilling.cold, prompt)
    assert (turn.tokens, turn.finish) == (cold.tokens, cold.finish)


def test_a_disk_hit_reads_every_stage_back_and_equals_a_cold_engine(spilling: Spilling) -> None:
    first = spilling.encode(SYSTEM + "Question one: what is a pipeline?")
    turn_one = ask(spilling.runner, first)
    spilling.wait_written(1)  # 1 KiB of memory: the entry went to disk on both stages
    snapshot = spilling.snapshot()
    assert (snapshot["bytes"], snapshot["disk_entries"], snapshot["spills"]) == (0, 1, 1)
    reports = status(spilling)
    assert [report["prefix_bytes"] for report in reports] == [0, 0]  # nothing left in memory
    second = first + tuple(turn_one.tokens) + spilling.encode(" And a second question?")
    turn_two = ask(spilling.runner, second)
    assert turn_two.cached == len(first) + len(turn_one.tokens) - 1
    assert spilling.snapshot()["disk_hits"] == 1
    assert_exact(spilling, second, turn_two)
    # turn two's entry replaced turn one's on both stages' disks
    spilling.wait_written(1)
    third = second + tuple(turn_two.tokens) + spilling.encode(" Third?")
    turn_three = ask(spilling.runner, third)
    assert turn_three.cached == len(second) + len(turn_two.tokens) - 1
    assert_exact(spilling, third, turn_three)


@pytest.mark.parametrize(
    ("stage", "damage"),
    [(1, "corrupt"), (0, "truncated")],
    ids=["stage-1-corrupt", "stage-0-truncated"],
)
def test_a_damaged_share_on_any_stage_is_a_miss_and_the_answer_is_right(
    spilling: Spilling, stage: int, damage: str
) -> None:
    first = spilling.encode(SYSTEM + "A conversation whose file will not survive.")
    turn_one = ask(spilling.runner, first)
    spilling.wait_written(1)
    (data,) = spilling.files(stage, "safetensors")
    content = bytearray(data.read_bytes())
    if damage == "corrupt":
        content[len(content) // 2] ^= 0xFF  # same size: only the digest can tell
    else:
        del content[len(content) // 2 :]
    data.write_bytes(bytes(content))
    second = first + tuple(turn_one.tokens) + spilling.encode(" Next?")
    turn_two = ask(spilling.runner, second)
    assert turn_two.cached == 0  # corrected after insert() had counted a hit
    snapshot = spilling.snapshot()
    assert (snapshot["disk_hits"], snapshot["disk_failures"]) == (1, 1)
    assert_exact(spilling, second, turn_two)
    # the damaged entry is gone everywhere; turn two's own entry serves the next turn
    spilling.wait_written(1)
    assert [report["prefix_entries"] for report in status(spilling)] == [0, 0]
    third = second + tuple(turn_two.tokens) + spilling.encode(" Last?")
    turn_three = ask(spilling.runner, third)
    assert turn_three.cached == len(second) + len(turn_two.tokens) - 1
    assert_exact(spilling, third, turn_three)


def test_the_disk_budget_holds_over_every_stage(demo_model_dir: Path, tmp_path: Path) -> None:
    probe = start_spilling(demo_model_dir, tmp_path / "probe", DISK_BYTES)
    try:
        ask(probe.runner, probe.encode(SYSTEM + "Topic 0."))
        probe.wait_written(1)  # (the runner ends the sequence just after its last token)
        entry_bytes = probe.snapshot()["disk_bytes"]  # one conversation's estimate
        assert entry_bytes > 0
    finally:
        probe.close()
    budget = int(entry_bytes * 2.5)  # room for two conversations
    bounded = start_spilling(demo_model_dir, tmp_path / "bounded", budget)
    try:
        for topic in range(5):
            ask(bounded.runner, bounded.encode(SYSTEM + f"Topic {topic}."))
        bounded.wait_written(2)
        snapshot = bounded.snapshot()
        assert snapshot["disk_entries"] == 2 and snapshot["disk_bytes"] <= budget
        on_disk = sum(
            path.stat().st_size for stage in (0, 1) for path in bounded.files(stage, "safetensors")
        )
        assert 0 < on_disk <= budget
        assert [report["prefix_entries"] for report in status(bounded)] == [0, 0]
    finally:
        bounded.close()
