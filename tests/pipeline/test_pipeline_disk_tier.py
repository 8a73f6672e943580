"""The prefix cache's disk tier on 2 real stages: every stage spills its layers' share of an
evicted entry to its own directory, a hit reads every share back and equals a cold engine, a
torn or corrupt share on any stage is a miss (still the right answer), the disk budget holds
over every stage's files, and a chain restarted with the same plan starts from the entries
its stages left (another plan, or a share missing on one stage: a miss, still right)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from discovery.cluster_key import generate_key
from engines.core.engine_options import EngineOptions
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
DISK_BYTES = 1 << 28


@dataclass
class Spilling:
    """Stages whose memory tier keeps nothing (every entry goes to disk), and a cold twin."""

    engine: EncryptedPipelineEngine
    runner: EngineRunner
    cold: EngineRunner
    directories: list[Path]  # each stage's share of the disk tier, stage 0 first
    workers: list[StageProcess]

    def close(self) -> None:
        self.runner.close()
        stop_workers(self.workers)

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.engine.tokenizer.encode(text))

    def files(self, stage: int, suffix: str = "json") -> list[Path]:
        return sorted(self.directories[stage].glob(f"*.{suffix}"))

    def wait_written(self, count: int) -> None:
        """Until every stage has `count` entries' files, both kinds (written and deleted in the
        background)."""
        deadline = time.monotonic() + 30
        stages = range(len(self.directories))
        while time.monotonic() < deadline:
            kinds = ("json", "safetensors")
            if all(len(self.files(stage, kind)) == count for stage in stages for kind in kinds):
                return
            time.sleep(0.05)
        raise AssertionError(f"stage files: {[self.files(stage) for stage in stages]}")

    def snapshot(self) -> dict[str, int]:
        return self.engine.info().detail["prefix_cache"]


def start_spilling(
    model: Path,
    root: Path,
    disk_bytes: int,
    cold: EngineRunner,
    ranges: list[range] = RANGES,
) -> Spilling:
    """A chain over `ranges` whose stage i keeps its disk tier under root/machine-i (as if
    each stage were a machine of its own): the same root after a restart finds its files."""
    key = generate_key()
    machines = [root / f"machine-{index}" for index in range(len(ranges))]
    listener = socket.create_server((HOST, 0))
    workers: list[StageProcess] = []
    next_port = listener.getsockname()[1]
    try:
        for index in reversed(range(1, len(ranges))):
            spec = {
                "model_path": str(model), "layers": [ranges[index].start, ranges[index].stop],
                "is_last": index == len(ranges) - 1, "listen_host": HOST, "next_host": HOST,
                "next_port": next_port, "cluster_key": key.hex(),
                "options": EngineOptions(
                    prefix_cache_disk_bytes=disk_bytes, prefix_cache_dir=str(machines[index])
                ).document(),
            }  # fmt: skip
            workers.insert(0, StageProcess.start(spec, ready_timeout_s=60))
            next_port = workers[0].port
        stages = [
            {"host": HOST, "port": worker.port, "layers": [layers.start, layers.stop]}
            for worker, layers in zip(workers, ranges[1:], strict=True)
        ]
        options = EngineOptions(
            prefill_chunk=16, prefix_cache_bytes=1024, prefix_cache_disk_bytes=disk_bytes,
            prefix_cache_dir=str(machines[0]),
        )  # fmt: skip
        engine = EncryptedPipelineEngine(
            model, ranges[0], stages, HOST, key, options=options, return_listener=listener
        )
        runner = EngineRunner(engine)
        runner.start(load_timeout_s=60)
    except BaseException:
        stop_workers(workers)
        listener.close()
        raise
    directories = [
        tier_root(machine, model, f"layers-{layers.start}-{layers.stop}")
        for machine, layers in zip(machines, ranges, strict=True)
    ]
    return Spilling(engine, runner, cold, directories, workers)


@pytest.fixture(scope="module")
def cold(demo_model_dir: Path) -> Iterator[EngineRunner]:
    runner = EngineRunner(SingleEngine(demo_model_dir))  # prefix cache off
    runner.start(load_timeout_s=60)
    try:
        yield runner
    finally:
        runner.close()


@pytest.fixture
def spilling(demo_model_dir: Path, tmp_path: Path, cold: EngineRunner) -> Iterator[Spilling]:
    setup = start_spilling(demo_model_dir, tmp_path, DISK_BYTES, cold)
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


def test_the_disk_budget_holds_over_every_stage(
    demo_model_dir: Path, tmp_path: Path, cold: EngineRunner
) -> None:
    probe = start_spilling(demo_model_dir, tmp_path / "probe", DISK_BYTES, cold)
    try:
        ask(probe.runner, probe.encode(SYSTEM + "Topic 0."))
        probe.wait_written(1)  # (the runner ends the sequence just after its last token)
        entry_bytes = probe.snapshot()["disk_bytes"]  # one conversation's estimate
        assert entry_bytes > 0
    finally:
        probe.close()
    budget = int(entry_bytes * 2.5)  # room for two conversations
    bounded = start_spilling(demo_model_dir, tmp_path / "bounded", budget, cold)
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


# -- across a restart ----------------------------------------------------------------------------


def first_turn_on_disk(model: Path, root: Path, cold: EngineRunner) -> tuple[tuple, Turn]:
    """A chain's first turn, its entry written to every stage's disk, then the chain stops."""
    chain = start_spilling(model, root, DISK_BYTES, cold)
    try:
        prompt = chain.encode(SYSTEM + "A conversation across a restart.")
        turn = ask(chain.runner, prompt)
        chain.wait_written(1)
    finally:
        chain.close()
    return prompt, turn


def test_a_restarted_chain_starts_from_the_entries_its_stages_left_on_disk(
    demo_model_dir: Path, tmp_path: Path, cold: EngineRunner
) -> None:
    first, turn_one = first_turn_on_disk(demo_model_dir, tmp_path, cold)
    chain = start_spilling(demo_model_dir, tmp_path, DISK_BYTES, cold)  # same stages, same plan
    try:
        assert chain.snapshot()["disk_entries"] == 1
        second = first + tuple(turn_one.tokens) + chain.encode(" And after the restart?")
        turn_two = ask(chain.runner, second)
        assert turn_two.cached == len(first) + len(turn_one.tokens) - 1
        assert_exact(chain, second, turn_two)
        snapshot = chain.snapshot()
        assert (snapshot["disk_hits"], snapshot["disk_failures"]) == (1, 0)
        chain.wait_written(1)  # turn two's entry replaced turn one's on both stages
    finally:
        chain.close()


def test_another_plan_reads_none_of_the_entries(
    demo_model_dir: Path, tmp_path: Path, cold: EngineRunner
) -> None:
    """Stage 0 keeps its layers, the others split differently: stage 0's entry has no share
    on the new stages, so it is forgotten (and its files removed), and the turn is a miss."""
    first, turn_one = first_turn_on_disk(demo_model_dir, tmp_path, cold)
    replanned = [RANGES[0], range(2, 3), range(3, 4)]
    chain = start_spilling(demo_model_dir, tmp_path, DISK_BYTES, cold, replanned)
    try:
        snapshot = chain.snapshot()
        assert (snapshot["disk_entries"], snapshot["disk_failures"]) == (0, 1)
        assert chain.files(0) == [] and chain.files(1) == [] and chain.files(2) == []
        second = first + tuple(turn_one.tokens) + chain.encode(" And with another plan?")
        turn_two = ask(chain.runner, second)
        assert turn_two.cached == 0
        assert_exact(chain, second, turn_two)
    finally:
        chain.close()


def test_an_entry_missing_on_one_stage_after_a_restart_is_a_miss(
    demo_model_dir: Path, tmp_path: Path, cold: EngineRunner
) -> None:
    first, turn_one = first_turn_on_disk(demo_model_dir, tmp_path, cold)
    stage_one = tier_root(tmp_path / "machine-1", demo_model_dir, "layers-2-4")
    for path in stage_one.glob("*.*"):
        path.unlink()
    chain = start_spilling(demo_model_dir, tmp_path, DISK_BYTES, cold)
    try:
        snapshot = chain.snapshot()
        assert (snapshot["disk_entries"], snapshot["disk_failures"]) == (0, 1)
        assert chain.files(0) == []  # forgotten on stage 0 too: the stages agree
        second = first + tuple(turn_one.tokens) + chain.encode(" And without stage 1's share?")
        turn_two = ask(chain.runner, second)
        assert turn_two.cached == 0
        assert_exact(chain, second, turn_two)
    finally:
        chain.close()
