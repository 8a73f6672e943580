"""Tensor parallel on real ring groups over 127.0.0.1: output, stopping, losing a rank."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from llguidance import LLMatcher

from cli.status import engine_steps, parse_metrics
from engines.api.constraints import JSON_OPTIONS
from engines.core.request import MAX_SEED, MAX_TOP_LOGPROBS, GenerationRequest
from engines.core.runner import EngineRunner
from engines.single.engine import SingleEngine
from engines.tensor_parallel import (
    TensorParallelEngine,
    WorkerSpec,
    jaccl_specs,
    loopback_ring_specs,
    ring_specs,
)
from engines.tensor_parallel.group import group_environment
from engines.tensor_parallel.lockstep import (
    STEP,
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
    request_of,
    request_words,
)
from engines.tensor_parallel.shard_batch import ShardBatch
from engines.tensor_parallel.step_commands import parse_insert, parse_step
from planner.errors import EngineError
from tests.helpers.api import chat_body, make_service, open_client
from tests.helpers.engine import (
    make_request,
    run_all,
    run_one,
    start_batch,
    step_until_error,
)
from tests.helpers.grammar import REPLY_SCHEMA, completes_to_object
from tests.helpers.tensor_parallel import (
    GRAMMAR,
    LOAD_TIMEOUT_S,
    PROJECT_ROOT,
    WORKER,
    Cluster,
    close_cluster,
    open_cluster,
    start_rank,
    stop_processes,
)
from tests.helpers.timing import check_request_shares, flow

PROMPTS = ("The quick brown fox", "Once upon a time, in a city by the sea,", "def main():")

pytestmark = pytest.mark.cluster


# -- helpers -------------------------------------------------------------------------------


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_runner(demo_model_dir: Path) -> Iterator[EngineRunner]:
    runner = EngineRunner(SingleEngine(demo_model_dir))
    runner.start(LOAD_TIMEOUT_S)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def cluster(demo_model_dir: Path) -> Iterator[Cluster]:
    cluster = open_cluster(demo_model_dir)
    yield cluster
    close_cluster(cluster)


@pytest.fixture(scope="module")
def tp_runner(cluster: Cluster) -> Iterator[EngineRunner]:
    runner = EngineRunner(cluster.engine)
    runner.start(LOAD_TIMEOUT_S)  # load() already ran; the runner only starts its thread
    yield runner
    runner.close()


@pytest.fixture(autouse=True)
def _engine_stays_healthy(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "tp_runner" in request.fixturenames:
        cluster = request.getfixturevalue("cluster")
        assert cluster.engine.healthy(), cluster.lost


# -- the shared two-rank cluster -----------------------------------------------------------


def test_greedy_output_equals_single_token_for_token(tp_runner, single_runner):
    for prompt in PROMPTS:
        expected = run_one(single_runner, make_request(single_runner.engine, prompt, 64))
        got = run_one(tp_runner, make_request(tp_runner.engine, prompt, 64))
        assert got.tokens == expected.tokens, prompt
        assert (got.text, got.finish) == (expected.text, expected.finish)
        assert len(got.tokens) >= 16  # the comparison means something
        assert got.events >= len(got.tokens) + 1  # streamed one event per token, then the end


def test_seeded_sampling_equals_single(tp_runner, single_runner):
    for seed in (7, 1234):
        options = {"temperature": 1.0, "top_p": 0.9, "seed": seed}
        expected = run_one(
            single_runner, make_request(single_runner.engine, PROMPTS[0], 32, **options)
        )
        got = run_one(tp_runner, make_request(tp_runner.engine, PROMPTS[0], 32, **options))
        assert got.tokens == expected.tokens
    greedy = run_one(single_runner, make_request(single_runner.engine, PROMPTS[0], 32))
    assert got.tokens != greedy.tokens  # sampling really sampled


def test_early_stops_leave_every_rank_ready_for_the_next_request(tp_runner, single_runner):
    full = run_one(single_runner, make_request(single_runner.engine, PROMPTS[1], 64))
    assert len(full.tokens) >= 40

    short = run_one(tp_runner, make_request(tp_runner.engine, PROMPTS[1], 3))
    assert (short.tokens, short.finish) == (full.tokens[:3], "length")

    # A stop string that first appears around the 20th token: the runner stops mid-sync-window.
    position = len(tp_runner.engine.tokenizer.decode(full.tokens[:20]))
    stop = full.text[position : position + 3]
    expected = run_one(
        single_runner, make_request(single_runner.engine, PROMPTS[1], 64, stop=(stop,))
    )
    stopped = run_one(tp_runner, make_request(tp_runner.engine, PROMPTS[1], 64, stop=(stop,)))
    assert stopped.finish == expected.finish == "stop"
    assert stopped.text == expected.text == full.text[: full.text.find(stop)]

    cancelled = run_one(
        tp_runner, make_request(tp_runner.engine, PROMPTS[1], 5_000), cancel_after=5
    )
    assert cancelled.finish == "cancelled"
    assert cancelled.tokens[:5] == full.tokens[:5]

    after = run_one(tp_runner, make_request(tp_runner.engine, PROMPTS[1], 64))
    assert after.tokens == full.tokens


def test_queued_requests_are_all_answered_correctly(tp_runner, single_runner):
    specs = [
        (PROMPTS[0], 24, {}),
        (PROMPTS[1], 16, {"temperature": 1.0, "seed": 5}),
        (PROMPTS[2], 24, {}),
        (PROMPTS[0], 8, {"temperature": 0.7, "top_p": 0.5, "seed": 9}),
    ]
    expected = [
        run_one(single_runner, make_request(single_runner.engine, p, n, **o)) for p, n, o in specs
    ]
    got = run_all(tp_runner, [make_request(tp_runner.engine, p, n, **o) for p, n, o in specs])
    assert [g.tokens for g in got] == [e.tokens for e in expected]
    assert all(g.finish in ("length", "stop") for g in got)


def test_penalties_and_logprobs_equal_single(tp_runner, single_runner):
    options = {"frequency_penalty": 1.5, "repetition_penalty": 1.2, "logprobs": 2}
    for runner_ in (single_runner, tp_runner):
        request = make_request(runner_.engine, PROMPTS[0], 24, **options)
        submission_events = run_events(runner_, request)
        tokens = [(e.token, e.top_logprobs and e.top_logprobs[0][0]) for e in submission_events]
        logprobs = [e.logprob for e in submission_events]
        if runner_ is single_runner:
            expected_tokens, expected_logprobs = tokens, logprobs
    assert tokens == expected_tokens
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)
    assert all(value is not None for value in logprobs)


# A forced tool call's shape (engines/api/constraints.py): text markers around a JSON call.
CALL = {**REPLY_SCHEMA, "x-guidance": JSON_OPTIONS}
TOOL_CALL = (
    f'start: "<tool_call>" "\\n" call "\\n" "</tool_call>"\ncall: %json {json.dumps(CALL)}\n'
)


def test_grammars_give_the_tokens_single_gives(tp_runner, single_runner):
    """JSON mode, a JSON schema and a forced tool call's grammar cross the lockstep: every rank
    masks the same tokens, so the output equals the single engine's, token for token."""
    assert "grammar" in tp_runner.engine.features
    schema = LLMatcher.grammar_from_json_schema(REPLY_SCHEMA, overrides=JSON_OPTIONS)
    tool_call = LLMatcher.grammar_from_lark(TOOL_CALL)
    cases = [
        (PROMPTS[0], 24, {"grammar": GRAMMAR}),
        (PROMPTS[1], 24, {"grammar": GRAMMAR, "temperature": 1.0, "seed": 3}),
        (PROMPTS[2], 48, {"grammar": schema}),
        (PROMPTS[0], 64, {"grammar": tool_call}),
        (PROMPTS[1], 24, {}),  # in the same batch, a sequence without a grammar stays free
    ]
    requests = [make_request(single_runner.engine, p, n, **o) for p, n, o in cases]
    expected = [run_one(single_runner, request) for request in requests]
    got = run_all(tp_runner, requests)
    assert [g.tokens for g in got] == [e.tokens for e in expected]
    assert [(g.text, g.finish) for g in got] == [(e.text, e.finish) for e in expected]
    json_object, sampled, answer, call, free = got
    for outcome in (json_object, sampled):
        if outcome.finish == "stop":  # the grammar closed the object, then EOS
            assert isinstance(json.loads(outcome.text), dict)
        else:
            assert completes_to_object(outcome.text), outcome.text
    value = json.loads(answer.text)
    assert set(value) == {"answer", "mood", "count"} and value["mood"] in ("calm", "wild")
    assert call.text.startswith("<tool_call>\n{") and call.text.endswith("}\n</tool_call>")
    assert json.loads(call.text.split("\n")[1])["mood"] in ("calm", "wild")
    assert not completes_to_object(free.text)


def test_a_bad_grammar_is_refused_for_its_sequence_only(tp_runner, single_runner):
    expected = run_one(single_runner, make_request(single_runner.engine, PROMPTS[0], 12))
    bad = [
        "not a grammar",
        LLMatcher.grammar_from_lark('start: "a" <[999999]>\n'),  # a token id the model lacks
    ]
    requests = [make_request(tp_runner.engine, PROMPTS[0], 12, grammar=g) for g in bad]
    *refused, good = run_all(tp_runner, [*requests, make_request(tp_runner.engine, PROMPTS[0], 12)])
    for outcome in refused:
        assert outcome.finish == "error" and "grammar" in outcome.error, outcome.error
        assert not outcome.tokens
    assert good.tokens == expected.tokens


def test_the_api_answers_json_mode_and_forced_tool_calls_over_tp(tp_runner, single_runner):
    """Through the API: tp no longer refuses the fields and answers what single answers."""
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    bodies = [
        chat_body(response_format={"type": "json_object"}, max_tokens=24),
        chat_body(tools=[weather], tool_choice="required", max_tokens=64),
    ]

    async def answers(runner: EngineRunner) -> list[dict[str, Any]]:
        async with open_client(make_service(runner)) as client:
            responses = [await client.post("/v1/chat/completions", json=b) for b in bodies]
        assert all(response.status_code == 200 for response in responses), responses[0].text
        choices = [response.json()["choices"][0] for response in responses]
        for choice in choices:  # call ids are random
            for call in choice["message"].get("tool_calls") or []:
                call.pop("id")
        return choices

    expected = asyncio.run(answers(single_runner))
    json_mode, tool_call = asyncio.run(answers(tp_runner))
    assert [json_mode, tool_call] == expected
    assert completes_to_object(json_mode["message"]["content"])
    assert tool_call["finish_reason"] == "tool_calls"
    [call] = tool_call["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")


def run_events(runner: EngineRunner, request: GenerationRequest) -> list[Any]:
    async def collect() -> list[Any]:
        events = [event async for event in runner.submit(request).events()]
        return [event for event in events if event.token is not None]

    return asyncio.run(asyncio.wait_for(collect(), 60))


def test_a_refused_request_keeps_the_group(tp_runner, single_runner):
    refused = run_one(tp_runner, GenerationRequest("bad", (10**6,), 8))
    assert refused.finish == "error" and "token ids" in refused.error
    expected = run_one(single_runner, make_request(single_runner.engine, PROMPTS[2], 8))
    assert (
        run_one(tp_runner, make_request(tp_runner.engine, PROMPTS[2], 8)).tokens == expected.tokens
    )


def test_info_describes_every_rank(cluster):
    info = cluster.engine.info()
    assert (info.strategy, info.world_size, info.detail["backend"]) == ("tp", 2, "ring")
    assert [rank["rank"] for rank in info.detail["ranks"]] == [0, 1]
    assert all(rank["peak_memory_bytes"] > 0 for rank in info.detail["ranks"])
    assert all(rank["address"].startswith("127.0.0.1:") for rank in info.detail["ranks"])


def test_step_timing_moves_in_metrics_and_request_records(tp_runner):
    """Requests through the API: rank 0's all_sum and step times reach /metrics and every
    request's record; the parts of a step fit inside the coordinator's round trip."""
    result = flow(tp_runner)
    steps = result.delta("tandem_engine_steps_total{}")
    assert steps >= 8  # 8 tokens each, one batch
    for segment in ("all_sum", "compute", "step", "exchange"):
        assert result.step_count(segment) == steps, segment
    assert result.step_sum("all_sum") > 0 and result.step_sum("compute") > 0
    assert result.step_sum("all_sum") + result.step_sum("compute") == pytest.approx(
        result.step_sum("step"), abs=1e-4
    )
    assert result.step_sum("step") <= result.step_sum("exchange")
    check_request_shares(result, ("all_sum", "compute", "step", "exchange"))
    status = engine_steps(parse_metrics(result.after_text))  # `tandem status`'s steps line
    assert "all_sum " in status and "exchange " in status
    detail = tp_runner.engine.info().detail["step_timing"]
    assert detail["segments"]["all_sum"]["buckets"][-1] == ["+Inf", detail["steps"]]


def test_a_batch_of_eight_equals_each_request_alone(tp_runner, single_runner):
    """Mixed sampling, stop strings, a cancel and a timeout in one batch; greedy rows exact."""
    reference = run_one(single_runner, make_request(single_runner.engine, PROMPTS[1], 48))
    stop = reference.text[len(reference.text) // 2 :][:3]
    specs = [
        (PROMPTS[0], 40, {}),
        (PROMPTS[1], 48, {}),
        (PROMPTS[2], 12, {}),
        (PROMPTS[0], 24, {"temperature": 1.0, "top_p": 0.9, "seed": 3}),
        (PROMPTS[1], 48, {"stop": (stop,)}),
        (PROMPTS[2], 30, {"temperature": 0.7, "seed": 11}),
        (PROMPTS[1], 5_000, {}),  # cancelled after 4 tokens
        (PROMPTS[0], 100_000, {"timeout_s": 1.0}),
    ]
    requests = [make_request(tp_runner.engine, p, n, **o) for p, n, o in specs]
    alone = [run_one(single_runner, r) for r in requests[:6]]
    got = run_all(tp_runner, requests, cancel_after={6: 4})
    for index in range(6):
        assert got[index].tokens == alone[index].tokens, index
        assert (got[index].finish, got[index].text) == (alone[index].finish, alone[index].text)
        assert got[index].completion_tokens == len(got[index].tokens)
        assert got[index].prompt_tokens == len(requests[index].prompt_tokens)
    assert got[4].finish == "stop" and stop not in got[4].text
    assert got[6].finish == "cancelled" and got[6].tokens[:4] == reference.tokens[:4]
    assert got[7].finish == "error" and "timed out" in got[7].error
    after = run_one(tp_runner, make_request(tp_runner.engine, PROMPTS[1], 48))
    assert after.tokens == reference.tokens


# -- losing a rank while a batch of 8 decodes (each test owns its cluster) --------------------


def test_killing_rank_1_mid_batch_raises_quickly(demo_model_dir):
    cluster = open_cluster(demo_model_dir, rank_nodes=("here", "node-b"))
    try:
        prompt = tuple(cluster.engine.tokenizer.encode(PROMPTS[0]))
        start_batch(cluster.engine, prompt, size=8, steps=4)
        cluster.ranks[0].kill()
        error, seconds = step_until_error(cluster.engine)
        assert seconds < 10
        assert "tensor-parallel rank 1 on node node-b (127.0.0.1:" in str(error)  # the culprit
        assert not cluster.engine.healthy()
        deadline = time.monotonic() + 5  # the supervisor is told from the reader thread
        while not cluster.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(cluster.lost) == 1 and "connection" in cluster.lost[0]
    finally:
        close_cluster(cluster)


def test_abort_unblocks_a_batch_stuck_on_a_frozen_rank(demo_model_dir):
    cluster = open_cluster(demo_model_dir, token_timeout_s=30, first_token_timeout_s=30)
    frozen = cluster.ranks[0]
    try:
        prompt = tuple(cluster.engine.tokenizer.encode(PROMPTS[0]))
        start_batch(cluster.engine, prompt, size=8, steps=2)
        os.kill(frozen.pid, signal.SIGSTOP)  # its sockets stay open: all_sum blocks, no error
        threading.Timer(1.0, cluster.engine.abort, ["agent lost"]).start()
        error, seconds = step_until_error(cluster.engine)
        assert seconds < 5  # long before the 30 s token timeout
        assert str(error) == "agent lost"  # the supervisor's reason names the culprit
        assert not cluster.engine.healthy()
        assert cluster.lost == []  # the supervisor called abort: no callback back to it
    finally:
        os.kill(frozen.pid, signal.SIGKILL)
        close_cluster(cluster)


def test_token_timeout_catches_a_frozen_rank(demo_model_dir):
    cluster = open_cluster(
        demo_model_dir, token_timeout_s=1.5, first_token_timeout_s=3, rank_nodes=("here", "b")
    )
    frozen = cluster.ranks[0]
    try:
        prompt = tuple(cluster.engine.tokenizer.encode(PROMPTS[0]))
        start_batch(cluster.engine, prompt, size=8, steps=2)
        os.kill(frozen.pid, signal.SIGSTOP)
        error, seconds = step_until_error(cluster.engine)
        assert seconds < 3.5
        assert "rank 1 on node b (127.0.0.1:" in str(error)  # the frozen one, not rank 0
        assert "did not answer rank 0 within 1.5 s" in str(error)
        assert not cluster.engine.healthy() and cluster.lost
    finally:
        os.kill(frozen.pid, signal.SIGKILL)
        close_cluster(cluster)


def test_an_idle_group_notices_a_rank_whose_agent_went_away(demo_model_dir):
    cluster = open_cluster(demo_model_dir)
    try:
        stdin = cluster.ranks[0].stdin
        assert stdin is not None
        stdin.close()  # what an agent that exits looks like to its worker
        assert cluster.ranks[0].wait(10) == 0
        deadline = time.monotonic() + 5
        while not cluster.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(cluster.lost) == 1  # noticed by the idle heartbeat, no request needed
        assert "connection" in cluster.lost[0]  # mlx: "closed by the peer" or "was lost"
        assert not cluster.engine.healthy()
        prompt = tuple(cluster.engine.tokenizer.encode(PROMPTS[0]))
        cluster.engine.insert(0, GenerationRequest("late", prompt, 4))
        with pytest.raises(EngineError, match=r"tensor-parallel rank 1 \(127\.0\.0\.1:"):
            cluster.engine.step()
    finally:
        close_cluster(cluster)


# -- other group shapes and refusals -------------------------------------------------------


def test_three_ranks_equal_single(demo_model_factory):
    model_dir = demo_model_factory(heads=6, kv_heads=3, layers=2)
    single = EngineRunner(SingleEngine(model_dir))
    single.start(LOAD_TIMEOUT_S)
    cluster = open_cluster(model_dir, world_size=3)
    tp = EngineRunner(cluster.engine)
    tp.start(LOAD_TIMEOUT_S)
    try:
        requests = [make_request(single.engine, prompt, 24) for prompt in PROMPTS]
        expected = run_all(single, requests)
        assert [o.tokens for o in run_all(tp, requests)] == [o.tokens for o in expected]
        assert cluster.engine.info().world_size == 3
    finally:
        tp.close()
        close_cluster(cluster)
        single.close()


def test_a_model_with_odd_heads_fails_to_load_with_the_reason(odd_heads_model_dir):
    specs = loopback_ring_specs(2, odd_heads_model_dir)
    rank1 = start_rank(specs[1])
    engine = TensorParallelEngine(odd_heads_model_dir, specs[0], load_timeout_s=LOAD_TIMEOUT_S)
    try:
        with pytest.raises(EngineError, match="divisible by 2.*3 attention heads"):
            engine.load()
        failed = json.loads(rank1.stdout.readline())
        assert failed["event"] == "failed" and "3 KV heads" in failed["reason"]
        assert rank1.wait(10) != 0
        assert not engine.healthy()
    finally:
        engine.close()
        stop_processes([rank1])


def test_an_invalid_spec_is_reported_on_stdout(tmp_path):
    process = subprocess.run(
        WORKER,
        input=json.dumps({"rank": 3, "world_size": 2, "backend": "ring"}) + "\n",
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=30,
    )
    event = json.loads(process.stdout)
    assert process.returncode == 2
    assert event["event"] == "failed" and "rank 3 is outside a world of size 2" in event["reason"]


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
        STEP, inserts, (2, 4), (5, 9), advance=False, sync=True, wait_after_s=0.032, spills=(7,)
    )
    payload = encode_payload(command)
    header, words = decode_header(encode_header(command, len(payload)))
    assert words == len(payload)
    assert (header.kind, header.advance, header.sync, header.wait_after_s) == (
        STEP,
        False,
        True,
        0.032,
    )
    assert decode_payload(payload) == ((2, 4), inserts, (5, 9), (7,))
    with pytest.raises(EngineError, match="out of step"):
        decode_payload(payload + [0])
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
    rest = follow_up[held:]
    got: list[int] = []
    resumed = Insert(1, GenerationRequest("rest", rest, 12), entry=0, cached=held)
    command = Command(STEP, (resumed,), evicts=(0,))
    while len(got) < 12:
        got += [token for _, token in batch.apply(command)]
        command = Command(STEP)
    assert got == cold
    assert 0 not in batch.prefixes  # evicted after the insert took its prefix
    batch.close()


def test_the_idle_wait_grows_to_the_heartbeat_and_survives_hours_of_idling():
    assert idle_wait_s(0, 1.0) == pytest.approx(0.002)
    assert idle_wait_s(3, 1.0) == pytest.approx(0.016)
    assert idle_wait_s(20, 1.0) == 1.0
    assert idle_wait_s(100_000, 1.0) == 1.0  # 2**100000 as a float would overflow
