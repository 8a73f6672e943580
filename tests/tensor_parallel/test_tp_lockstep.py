"""The lockstep protocol, shard batches and rank specs, in-process."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from engines.core.request import MAX_SEED, MAX_TOP_LOGPROBS, GenerationRequest
from engines.tensor_parallel import WorkerSpec, jaccl_specs, ring_specs
from engines.tensor_parallel.group import group_environment
from engines.tensor_parallel.lockstep import (
    NEXT_STEP_GRACE_S,
    PING,
    STEP,
    TOP_ENTRY_ID,
    Command,
    DivergenceError,
    Insert,
    Lockstep,
    check_sync,
    decode_header,
    decode_payload,
    encode_header,
    encode_payload,
    idle_wait_s,
    ping_after_s,
    request_of,
    request_words,
)
from engines.tensor_parallel.shard_batch import ShardBatch
from engines.tensor_parallel.step_commands import parse_insert, parse_step
from errors import EngineError
from tests.helpers.engine import run_one
from tests.helpers.tensor_parallel import GRAMMAR, PROMPTS

pytestmark = pytest.mark.cluster

# -- the lockstep protocol and specs, in-process -------------------------------------------


def test_step_commands_round_trip_exact_floats_and_large_seeds():
    def sequence(uid: int, prompt: tuple[int, ...], max_tokens: int, **fields: Any) -> Any:
        return GenerationRequest(f"r{uid}", prompt, max_tokens, **fields)

    full = sequence(
        7, (5, 6, 7), 99, seed=MAX_SEED, temperature=0.7, top_p=0.95, stop=("\u00e9", "."),
        repetition_penalty=1.3, presence_penalty=0.25, frequency_penalty=-0.1, logprobs=3,
    )  # fmt: skip
    inserts = (
        Insert(7, full),
        Insert(8, sequence(8, (1,), 3, seed=0), entry=5, cached=40),
        # documents of every length modulo 4 and multi-byte UTF-8 cross in whole words
        *(
            Insert(9 + size, sequence(9, (2, 3), 4, grammar=text), entry=size, cached=size + 1)
            for size, text in enumerate(("x", "{}", '\u00e9"', "\u20ac\U0001f600", GRAMMAR))
        ),
    )
    command = Command(
        STEP, inserts, (2, 4), (5, 9), advance=False, sync=True, wait_after_s=0.032, spills=(7,),
        keeps=((3, TOP_ENTRY_ID), (4, TOP_ENTRY_ID - 1)),
    )  # fmt: skip
    payload = encode_payload(command)
    header, words = decode_header(encode_header(command, len(payload)))
    assert words == len(payload)
    assert (header.kind, header.advance, header.sync, header.wait_after_s) == (
        STEP,
        False,
        True,
        0.032,
    )
    changes = decode_payload(payload)  # the header's fields come from the header
    assert changes == replace(command, advance=True, sync=False, wait_after_s=0.0)
    with pytest.raises(EngineError, match="out of step"):
        decode_payload(payload + [0])
    with pytest.raises(EngineError, match="keeps need 4 words, got 3"):
        decode_payload(payload[:-1])  # the last keep cut short
    length, document = request_words(full)
    assert request_of(length, document) == full
    assert len(document) == -(-length // 4)
    one = encode_payload(Command(STEP, (Insert(1, sequence(1, (2,), 3, grammar="abcde")),)))
    with pytest.raises(EngineError, match="out of step"):
        decode_payload(one[:-2] + one[-1:])  # a document word lost
    # a document every rank could read but no request may carry: out of step, not inserted
    bad = encode_payload(Command(STEP, (Insert(1, replace(full, temperature=2.5)),)))
    with pytest.raises(EngineError, match="temperature must be"):
        decode_payload(bad)


def test_rank_zero_checks_each_insert_and_refuses_it_alone():
    good = GenerationRequest("g", (1, 2), 4, seed=3)
    message = {"uid": 1, "entry": -1, "cached": 0, "request": good.document()}
    assert parse_insert(message, 100) == Insert(1, good)
    for change, reason in (
        ({"prompt_tokens": [1, 100]}, "token ids must be integers in \\[0, 100\\)"),
        ({"seed": None, "temperature": 0.5}, "seed must be set"),
        ({"seed": MAX_SEED + 1}, "seed must be"),
        ({"top_p": 0}, "top_p must be"),
        ({"max_tokens": 0}, "max_tokens must be"),
        ({"logprobs": MAX_TOP_LOGPROBS + 1}, "logprobs must be"),
        ({"unknown": 1}, "not a request field"),
    ):
        document = {**good.document(), **change}
        with pytest.raises(ValueError, match=reason):
            parse_insert({**message, "request": document}, 100)
    command, refused = parse_step({"insert": [{**message, "request": None}, message]}, 100)
    assert command.inserts == (Insert(1, good),)
    assert refused == [(1, "request must be a JSON object, got None")]


def test_sync_detects_diverging_ranks():
    check_sync([42, 42, 42])
    with pytest.raises(DivergenceError, match=r"ranks \[2\]"):
        check_sync([42, 42, 41])


def test_a_shard_batch_in_a_group_of_one_equals_single(demo_model_dir, single_runner):
    """The ranks' batch code path, without a ring: the same tokens as SingleEngine."""
    engine = single_runner.engine
    prompts = [tuple(engine.tokenizer.encode(p)) for p in PROMPTS]
    expected = [
        run_one(single_runner, GenerationRequest(f"s{i}", p, 16)).tokens
        for i, p in enumerate(prompts)
    ]
    lockstep = Lockstep(mx.distributed.init())  # a group of one: the same broadcasts
    batch = ShardBatch(engine.model, max_batch=4)
    inserts = tuple(Insert(i, GenerationRequest(f"s{i}", p, 16)) for i, p in enumerate(prompts))
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    command = lockstep.broadcast_command(Command(STEP, inserts))
    while any(len(tokens) < 16 for tokens in got.values()):
        for uid, token in batch.apply(command):
            got[uid].append(token)
        command = lockstep.broadcast_command(Command(STEP))
    assert [got[i] for i in range(len(prompts))] == expected
    batch.apply(Command(STEP, removes=(0, 1, 2), advance=False))
    assert len(batch) == 0
    batch.close()


def test_specs_for_ring_and_jaccl(tmp_path):
    ring = ring_specs(["10.0.0.1", "10.0.0.2"], [5000, 5001], "/models/m", sync_every=4)
    assert [spec["rank"] for spec in ring] == [0, 1]
    assert ring[1]["hosts"] == [["10.0.0.1:5000"], ["10.0.0.2:5001"]]
    assert ring[0]["sync_every"] == 4 and ring[0]["backend"] == "ring"
    environment = group_environment(WorkerSpec.from_dict(ring[1]), tmp_path)
    assert environment["MLX_RANK"] == "1"
    assert json.loads(Path(environment["MLX_HOSTFILE"]).read_text()) == ring[1]["hosts"]

    devices = [[None, "rdma_en3"], ["rdma_en3", None]]
    jaccl = jaccl_specs(devices, "10.0.0.1:5500", "/models/m")
    environment = group_environment(WorkerSpec.from_dict(jaccl[1]), tmp_path)
    assert environment["MLX_JACCL_COORDINATOR"] == "10.0.0.1:5500"
    assert json.loads(Path(environment["MLX_IBV_DEVICES"]).read_text()) == devices

    with pytest.raises(ValueError, match="2 addresses but 1 ports"):
        ring_specs(["a", "b"], [1], "/m")
    with pytest.raises(ValueError, match="2x2 ibv_devices"):
        jaccl_specs([[None, "x"], ["x"]], "h:1", "/m")
    with pytest.raises(ValueError, match="unknown worker spec keys"):
        WorkerSpec.from_dict({**ring[0], "hosst": []})


def test_a_shard_batch_keeps_ended_sequences_and_starts_from_them(single_runner):
    """Rank-local prefix entries: a removed sequence is kept under its uid; a later insert
    that names it prefills only the rest and samples what a cold start samples."""
    engine = single_runner.engine
    shared = tuple(engine.tokenizer.encode(" ".join(PROMPTS) * 4))
    follow_up = shared + tuple(engine.tokenizer.encode(" and so on"))
    cold = run_one(single_runner, GenerationRequest("cold", follow_up, 12)).tokens
    batch = ShardBatch(engine.model, max_batch=4, keep_prefixes=True)
    batch.apply(Command(STEP, (Insert(0, GenerationRequest("shared", shared, 1)),)))
    batch.apply(Command(STEP, removes=(0,), advance=False))
    ((uid, held, nbytes),) = batch.drain_kept()
    assert uid == 0 and held <= len(shared) and nbytes > 0
    got: list[int] = []
    resumed = Insert(1, GenerationRequest("rest", follow_up, 12), entry=0, cached=held)
    command = Command(STEP, (resumed,), evicts=(0,))
    while len(got) < 12:
        got += [token for _, token in batch.apply(command)]
        command = Command(STEP)
    assert got == cold
    assert batch.prefilled_tokens == len(shared) + len(follow_up) - held
    assert 0 not in batch.prefixes  # evicted after the insert took its prefix
    batch.close()


def test_the_idle_wait_grows_to_the_heartbeat_and_survives_hours_of_idling():
    assert idle_wait_s(0, 1.0) == pytest.approx(0.002)
    assert idle_wait_s(3, 1.0) == pytest.approx(0.016)
    assert idle_wait_s(20, 1.0) == 1.0
    assert idle_wait_s(100_000, 1.0) == 1.0  # 2**100000 as a float would overflow


def test_rank_0_waits_a_grace_for_the_next_step_before_sending_the_ranks_to_sleep():
    # a step's successor comes a few ms later: a ping right away would put every rank to
    # sleep for idle_wait_s, and the next step would wait for them (4 ms a token in the lab)
    assert ping_after_s(Command(STEP, advance=True)) == NEXT_STEP_GRACE_S
    assert NEXT_STEP_GRACE_S > idle_wait_s(1, 1.0)
    # while idle, the pings keep their growing schedule
    assert ping_after_s(Command(PING, wait_after_s=idle_wait_s(3, 1.0))) == idle_wait_s(3, 1.0)
