"""The sealed pipeline on real stage processes: batches of SingleEngine's tokens, fast failure."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from cli.status import engine_steps, parse_metrics
from discovery.cluster_key import generate_key
from engines.api.dashboard_view import render_requests
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.pipeline import sequence_documents, wire
from engines.pipeline.engine import EncryptedPipelineEngine
from engines.pipeline.schedule import MicroBatchSchedule, Planned
from engines.pipeline.stage_model import StageModel
from engines.pipeline.stage_spec import StageSpec
from engines.pipeline.stage_worker import StageProcess
from engines.pipeline.wire import PREFILL_GROUP, Row
from planner import allocate_layers
from planner.errors import ConfigError, EngineError
from tests.helpers.pipeline import (
    HOST,
    LONG_PROMPT,
    PROMPTS,
    Outcome,
    Pipeline,
    assert_same,
    collect,
    make_engine,
    make_request,
    open_pipeline,
    run,
    run_all,
    start_workers,
    status,
    stop_workers,
)
from tests.helpers.strangers import open_strangers
from tests.helpers.timing import check_request_shares, flow

pytestmark = pytest.mark.cluster

# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_key() -> bytes:
    return generate_key()


@pytest.fixture(scope="module")
def five_layer_model(demo_model_factory: Any) -> Path:
    return demo_model_factory(layers=5)


@pytest.fixture(scope="module")
def two_stages(
    demo_model_dir: Path, cluster_key: bytes, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    """The 4-layer demo model as [0, 2) here and [2, 4) in a worker; default 256-token chunks."""
    ranges = allocate_layers(4, [8, 8])
    yield from open_pipeline(
        demo_model_dir, ranges, cluster_key, tmp_path_factory.mktemp("two-stages")
    )


@pytest.fixture(scope="module")
def three_stages(
    five_layer_model: Path, cluster_key: bytes, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    """5 layers over unequal memory: an uneven split, and small chunks so prefill is chunked."""
    ranges = allocate_layers(5, [20, 6, 6])
    assert [len(r) for r in ranges] == [3, 1, 1]
    yield from open_pipeline(
        five_layer_model, ranges, cluster_key, tmp_path_factory.mktemp("three"), prefill_chunk=16
    )


@pytest.fixture(params=["two_stages", "three_stages"])
def pipeline(request: pytest.FixtureRequest) -> Pipeline:
    return request.getfixturevalue(request.param)


# -- the same tokens as SingleEngine -------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_matches_single_engine(pipeline: Pipeline, prompt: str) -> None:
    outcome = assert_same(pipeline, make_request(pipeline.runner, prompt))
    assert outcome.completion_tokens > 0


@pytest.mark.parametrize(
    ("chunks", "extra"), [(0, 1), (2, 0), (2, 1)], ids=["one-token", "whole-chunks", "and-one"]
)
def test_the_last_chunk_samples_the_first_token_at_any_length(
    three_stages: Pipeline, chunks: int, extra: int
) -> None:
    """A prompt's last prefill chunk, whatever its length (one token, a whole chunk, one token
    after whole chunks), samples the first token: the single engine's tokens."""
    length = chunks * three_stages.engine.prefill_chunk + extra
    tokens = tuple(three_stages.engine.tokenizer.encode(LONG_PROMPT))[:length]
    assert len(tokens) == length
    assert_same(three_stages, GenerationRequest(f"edge-{length}", tokens, max_tokens=16))


def test_long_prompt_is_chunked_and_matches(pipeline: Pipeline) -> None:
    request = make_request(pipeline.runner, LONG_PROMPT, max_tokens=32)
    assert len(request.prompt_tokens) > pipeline.engine.prefill_chunk + 1
    assert_same(pipeline, request)


@pytest.mark.parametrize(("temperature", "top_p", "seed"), [(1.0, 1.0, 1234), (0.8, 0.9, 7)])
def test_seeded_sampling_matches_single_engine(
    pipeline: Pipeline, temperature: float, top_p: float, seed: int
) -> None:
    request = make_request(
        pipeline.runner, PROMPTS[2], temperature=temperature, top_p=top_p, seed=seed
    )
    outcome = assert_same(pipeline, request)
    greedy = run(pipeline.reference, make_request(pipeline.runner, PROMPTS[2]))
    assert outcome.tokens != greedy.tokens  # sampling really happened


def scored_events(runner: EngineRunner, request: GenerationRequest) -> list[Any]:
    async def collect() -> list[Any]:
        events = [event async for event in runner.submit(request).events()]
        return [event for event in events if event.token is not None]

    return asyncio.run(asyncio.wait_for(collect(), 60))


def test_penalties_and_logprobs_match_single_engine(pipeline: Pipeline) -> None:
    """Penalties run at the last stage on the raw logits, logprobs travel in TOKEN frames."""
    options = {"repetition_penalty": 1.3, "frequency_penalty": 1.5, "presence_penalty": 0.5}
    request = make_request(pipeline.runner, PROMPTS[0], max_tokens=24, logprobs=3, **options)
    expected = scored_events(pipeline.reference, request)
    got = scored_events(pipeline.runner, request)
    assert [event.token for event in got] == [event.token for event in expected]
    assert [event.logprob for event in got] == pytest.approx(
        [event.logprob for event in expected], abs=1e-4
    )
    assert [[t for t, _ in e.top_logprobs] for e in got] == [
        [t for t, _ in e.top_logprobs] for e in expected
    ]
    assert all(len(event.top_logprobs) == 3 for event in got)
    plain = scored_events(pipeline.runner, make_request(pipeline.runner, PROMPTS[0], 24))
    assert all(event.logprob is None for event in plain)


def test_cancel_frees_every_stage_and_the_next_request_is_exact(pipeline: Pipeline) -> None:
    before = status(pipeline)
    request = make_request(pipeline.runner, PROMPTS[0], max_tokens=500)
    cancelled = run(pipeline.runner, request, cancel_after=5)
    assert cancelled.finish == "cancelled"
    assert 5 <= len(cancelled.tokens) < 500
    after = status(pipeline)
    assert [report["layers"] for report in after] == [[r.start, r.stop] for r in pipeline.ranges]
    assert all(report["active_requests"] == 0 for report in after)
    assert [r["served_requests"] for r in after[1:]] == [
        r["served_requests"] + 1 for r in before[1:]
    ]
    assert_same(pipeline, make_request(pipeline.runner, PROMPTS[1]))


# -- batches -------------------------------------------------------------------------------------

BATCH_PROMPTS = (*PROMPTS, "A", "Why not", LONG_PROMPT[:200], "tell me a story about a cat")


def test_greedy_batch_matches_single_engine_alone(pipeline: Pipeline) -> None:
    """Eight greedy requests at once: each gets the tokens SingleEngine gives it alone."""
    requests = [
        make_request(pipeline.runner, prompt, max_tokens=24 + 5 * index)
        for index, prompt in enumerate(BATCH_PROMPTS)
    ]
    alone = [run(pipeline.reference, request) for request in requests]
    together = run_all(pipeline.runner, requests)
    assert [outcome.tokens for outcome in together] == [outcome.tokens for outcome in alone]
    assert [outcome.finish for outcome in together] == [outcome.finish for outcome in alone]
    assert status(pipeline)[1]["active_requests"] == 0


def test_burst_of_eight_ends_every_request_correctly(pipeline: Pipeline) -> None:
    """Different lengths, stops and temperatures, one cancelled, one timing out, all at once."""
    runner = pipeline.runner
    stopper = make_request(runner, PROMPTS[2], max_tokens=64)
    stop_word = run(pipeline.reference, stopper).text.split()[3]
    requests = [
        make_request(runner, PROMPTS[0], max_tokens=48),
        make_request(runner, PROMPTS[1], max_tokens=3),
        make_request(runner, PROMPTS[2], max_tokens=40, temperature=1.0, seed=1234),
        make_request(runner, PROMPTS[3], max_tokens=30, temperature=0.8, top_p=0.9, seed=7),
        make_request(runner, PROMPTS[2], max_tokens=64, stop=(stop_word,)),
        make_request(runner, LONG_PROMPT, max_tokens=20),
        make_request(runner, PROMPTS[1], max_tokens=500),  # cancelled after 4 tokens
        make_request(runner, PROMPTS[0], max_tokens=100_000, timeout_s=2.0),
    ]
    expected = [run(pipeline.reference, request) for request in requests[:6]]
    outcomes = run_all(runner, requests, cancel_after={6: 4})
    for got, want in zip(outcomes[:6], expected, strict=True):
        assert (got.tokens, got.text, got.finish) == (want.tokens, want.text, want.finish)
        assert got.completion_tokens == want.completion_tokens
    assert outcomes[1].completion_tokens == 3 and outcomes[1].finish == "length"
    assert outcomes[4].finish == "stop" and stop_word not in outcomes[4].text
    greedy = run(pipeline.reference, make_request(runner, PROMPTS[1], max_tokens=100)).tokens
    cancelled, timed_out = outcomes[6], outcomes[7]
    assert cancelled.finish == "cancelled" and 4 <= len(cancelled.tokens) < 500
    assert cancelled.tokens == greedy[: len(cancelled.tokens)]
    assert cancelled.completion_tokens == len(cancelled.tokens)
    assert timed_out.finish == "error" and "timed out after 2 s" in (timed_out.error or "")
    assert timed_out.completion_tokens == len(timed_out.tokens) > 0
    assert all(report["active_requests"] == 0 for report in status(pipeline))
    assert_same(pipeline, make_request(runner, PROMPTS[3], max_tokens=16))


def test_long_prefill_does_not_freeze_running_streams(three_stages: Pipeline) -> None:
    """A newcomer's long prompt is prefilled a chunk per step between the others' tokens."""
    runner = three_stages.runner
    running = make_request(runner, PROMPTS[0], max_tokens=1000)
    newcomer = make_request(runner, LONG_PROMPT * 2, max_tokens=1)
    chunks = len(newcomer.prompt_tokens) // three_stages.engine.prefill_chunk
    assert chunks >= 10
    stamps: list[float] = []
    warm = asyncio.Event()

    async def keep_streaming() -> Outcome:
        submission = runner.submit(running)
        async for event in submission.events():
            stamps.append(time.monotonic())
            if len(stamps) == 5:
                warm.set()
            if event.finish_reason is not None:
                return Outcome([], "", event.finish_reason, event.error, event.completion_tokens)
        raise AssertionError("no final event")

    async def arrive_late(stream: asyncio.Task) -> tuple[float, float, Outcome]:
        await warm.wait()
        submitted = time.monotonic()
        outcome = await collect(runner, newcomer)
        answered = time.monotonic()
        for submission in runner.running():
            submission.cancel()
        await stream
        return submitted, answered, outcome

    async def race() -> tuple[float, float, Outcome]:
        stream = asyncio.ensure_future(keep_streaming())
        return await arrive_late(stream)

    submitted, answered, late = asyncio.run(asyncio.wait_for(race(), timeout=60))
    assert late.finish == "length"
    during = [stamp for stamp in stamps if submitted < stamp < answered]
    assert len(during) >= chunks // 2, (len(during), chunks)


# -- refusals ------------------------------------------------------------------------------------


def test_info_describes_every_stage(three_stages: Pipeline) -> None:
    info = three_stages.engine.info()
    assert (info.strategy, info.world_size) == ("pp", 3)
    assert info.detail["micro_batches"] == 3
    stages = info.detail["stages"]
    assert [stage["layers"] for stage in stages] == [[0, 3], [3, 4], [4, 5]]
    assert all(stage["peak_memory_bytes"] > 0 for stage in stages)
    workers = three_stages.workers
    assert [stage["peak_memory_bytes"] for stage in stages[1:]] == [
        worker.peak_memory_bytes for worker in workers
    ]
    assert three_stages.engine.healthy()


def test_frame_timing_moves_in_metrics_and_request_records(three_stages: Pipeline) -> None:
    """Requests through the API: every answered frame is split into the coordinator's layers,
    each remote stage's, sealing and transit; /metrics and the request records show them."""
    result = flow(three_stages.runner)
    frames = result.delta("tandem_engine_steps_total{}")
    assert frames >= 8  # 8 tokens each, and the prefill chunks
    segments = ("stage0", "stage1", "stage2", "seal", "transit", "round_trip")
    for segment in segments:
        assert result.step_count(segment) == frames, segment
    for segment in ("stage0", "stage1", "stage2", "seal", "round_trip"):
        assert result.step_sum(segment) > 0, segment
    # each round trip holds its remote stages' work, less what the deltas over-count
    remote = result.step_sum("stage1") + result.step_sum("stage2")
    assert remote < result.step_sum("round_trip")
    # stage 0 runs on the scheduler thread, one frame after the other: inside the request's
    # own time (a request's frames may be in flight together, so its round trips may not be)
    check_request_shares(result, ("stage0",))
    assert all(set(segments) <= {name for name, _ in r.engine_s} for r in result.records)
    assert "stage2 " in render_requests(result.records)  # the dashboard's request rows
    assert "seal " in engine_steps(parse_metrics(result.after_text))  # `tandem status`


def test_frames_carry_stage_times_and_only_answers_and_activations_may() -> None:
    hidden = mx.zeros((1, 1, 4), dtype=mx.float32)
    frame = wire.hidden_frame(3, 0, 1, [Row(7, 2)], hidden, [(10, 2), (2**40, 5)])
    decoded = wire.decode(wire.encode(frame))
    assert decoded.times == ((10, 2), (2**40, 5)) and decoded.body == frame.body
    assert wire.decode(wire.encode(wire.token_frame(3, 0, 1, [Row(7, 3)], [5]))).times == ()
    plain = wire.encode(sequence_documents.end_frame(4, [7]))
    flagged = plain[:2] + bytes([wire.STAGE_TIMES]) + plain[3:]
    with pytest.raises(wire.WireError, match="carries stage times"):
        wire.decode(flagged)
    cut = wire.encode(frame)[: wire.HEADER.size + 3 * 4 + wire.ROW.size + 5]
    with pytest.raises(wire.WireError, match="inside its stage times"):
        wire.decode(cut)


def test_reconnect_builds_a_fresh_session(three_stages: Pipeline) -> None:
    served = [report["served_requests"] for report in status(three_stages)[1:]]
    three_stages.engine.connect()  # new handshakes, new session keys, frame numbers from 1
    assert [report["served_requests"] for report in status(three_stages)[1:]] == served
    assert_same(three_stages, make_request(three_stages.runner, PROMPTS[3]))


def test_wrong_cluster_key_is_refused_and_the_session_survives(
    two_stages: Pipeline, demo_model_dir: Path
) -> None:
    ranges = two_stages.ranges
    engine = make_engine(demo_model_dir, ranges, generate_key(), None, two_stages.workers)
    started = time.monotonic()
    try:
        with pytest.raises(EngineError, match="prove the cluster key|handshake"):
            engine.load()
    finally:
        engine.close()
    assert time.monotonic() - started < 10
    assert two_stages.engine.healthy()
    assert_same(two_stages, make_request(two_stages.runner, PROMPTS[1], max_tokens=16))


def test_out_of_range_sampling_is_refused_before_the_chain(two_stages: Pipeline) -> None:
    refused = run(two_stages.runner, make_request(two_stages.runner, PROMPTS[0], temperature=-1.0))
    reason = "temperature must be a number in [0, 2], got -1.0"  # GenerationRequest.check
    assert refused.finish == "error" and reason in (refused.error or ""), refused.error
    assert two_stages.engine.healthy()
    assert_same(two_stages, make_request(two_stages.runner, PROMPTS[0], max_tokens=8))


# -- losing a stage ------------------------------------------------------------------------------


@pytest.fixture
def fragile(five_layer_model: Path, cluster_key: bytes, tmp_path: Path) -> Iterator[Any]:
    """A private 3-stage pipeline a test may kill or freeze; always cleaned up."""
    ranges = allocate_layers(5, [1, 1, 1])
    listener, workers = start_workers(five_layer_model, ranges, cluster_key, tmp_path)
    engine = make_engine(
        five_layer_model, ranges, cluster_key, listener, workers, token_timeout_s=2.0
    )
    try:
        engine.load()
        yield engine, workers
    finally:
        engine.close()
        stop_workers(workers)


def long_requests(engine: EncryptedPipelineEngine, count: int = 8) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"doomed-{index}",
            tuple(engine.tokenizer.encode(PROMPTS[index % len(PROMPTS)])),
            max_tokens=100_000,
        )
        for index in range(count)
    ]


def decode_a_while(engine: EncryptedPipelineEngine, tokens: int = 40) -> None:
    """Insert a batch of 8 and step until `tokens` tokens came back (all 8 decoding)."""
    for uid, request in enumerate(long_requests(engine)):
        engine.insert(uid, request)
    seen: set[int] = set()
    produced = 0
    while produced < tokens or len(seen) < 8:
        outputs = engine.step()
        seen.update(output.uid for output in outputs)
        produced += len(outputs)


@pytest.mark.parametrize("victim", [0, 1])
def test_killed_stage_fails_the_batch_fast(fragile: Any, victim: int) -> None:
    engine, workers = fragile
    decode_a_while(engine)
    workers[victim].popen.kill()
    workers[victim].popen.wait(5)
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"pipeline stage lost .*\(8 sequences\)") as caught:
        while True:
            engine.step()
            assert time.monotonic() - started < 10
    assert time.monotonic() - started < 10
    assert not engine.healthy()
    # every stage the frames pass is named, with its layers and address
    for index, stage in enumerate(engine.stages, 1):
        assert stage.describe(index) in str(caught.value)
    assert "layers [" in str(caught.value)
    assert "failure" in engine.info().detail
    engine.remove(range(8))  # as the runner does: the batch is gone
    engine.insert(100, long_requests(engine, 1)[0])
    started = time.monotonic()
    with pytest.raises(EngineError):  # the next step tries to reconnect and cannot
        engine.step()
    assert time.monotonic() - started < 12


def test_frozen_stage_times_out(fragile: Any) -> None:
    engine, workers = fragile
    decode_a_while(engine)
    os.kill(workers[1].pid, signal.SIGSTOP)  # alive but silent: only a timeout catches it
    try:
        started = time.monotonic()
        with pytest.raises(EngineError, match="pipeline stage lost"):
            while True:
                engine.step()
        assert time.monotonic() - started < engine.token_timeout_s + 3
        assert not engine.healthy()
    finally:
        os.kill(workers[1].pid, signal.SIGCONT)


def test_abort_wakes_a_blocked_step(fragile: Any) -> None:
    engine, workers = fragile
    engine.token_timeout_s = 60.0
    decode_a_while(engine, tokens=8)
    os.kill(workers[0].pid, signal.SIGSTOP)
    timer = threading.Timer(0.5, engine.abort, args=("operator requested a re-plan",))
    try:
        started = time.monotonic()
        timer.start()
        with pytest.raises(EngineError, match="re-plan"):
            while True:
                engine.step()
        assert time.monotonic() - started < 5
    finally:
        timer.cancel()
        os.kill(workers[0].pid, signal.SIGCONT)


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_lost_stage_ends_every_stream_of_a_batch_with_an_error(fragile: Any, fault: str) -> None:
    engine, workers = fragile
    runner = EngineRunner(engine)
    runner.start(load_timeout_s=10)  # load() again: a fresh session
    victim = workers[1]
    try:
        if fault == "kill":
            timer = threading.Timer(1.0, victim.popen.kill)
        else:
            timer = threading.Timer(1.0, os.kill, args=(victim.pid, signal.SIGSTOP))
        timer.start()
        started = time.monotonic()
        outcomes = run_all(runner, long_requests(engine))
        elapsed = time.monotonic() - started
        timer.join()
        assert [outcome.finish for outcome in outcomes] == ["error"] * 8
        assert all("pipeline stage lost" in (outcome.error or "") for outcome in outcomes)
        assert all(outcome.tokens for outcome in outcomes)  # they were decoding
        assert elapsed < 1.0 + engine.token_timeout_s + 3
        assert not engine.healthy()
    finally:
        if victim.popen.poll() is None:
            os.kill(victim.pid, signal.SIGCONT)
        runner.close()


# -- the coordinator's schedule, socket-free -----------------------------------------------------


def describe(frames: list[Planned]) -> list[tuple]:
    return [(frame.group, frame.step, frame.rows, frame.tokens, frame.begins) for frame in frames]


def test_schedule_plans_prefill_and_decode_frames() -> None:
    schedule = MicroBatchSchedule(groups=2, prefill_chunk=2, prefill_in_flight=2)
    schedule.add(2, [20])  # one token: its only chunk is its last, which samples
    schedule.add(1, [10, 11, 12, 13])  # chunks [10, 11] and [12, 13], the last sampling
    frames = schedule.plan()  # nobody decodes: two chunks fill the pipe
    assert describe(frames) == [
        (PREFILL_GROUP, 1, (Row(2, 0),), (20,), (2,)),
        (PREFILL_GROUP, 2, (Row(1, 0),), (10, 11), (1,)),
    ]
    assert [frame.last_chunk for frame in frames] == [True, False]
    assert schedule.answered([7]) == [(2, 7)]  # 2's first token: it joins micro-batch 0
    assert describe(schedule.plan()) == [(0, 1, (Row(2, 1),), (7,), ())]  # one chunk is out
    assert schedule.answered([]) == []  # the chunk's acknowledgement
    frames = schedule.plan()  # one chunk at a time while 2 decodes
    assert describe(frames) == [(PREFILL_GROUP, 3, (Row(1, 2),), (12, 13), ())]
    assert frames[0].last_chunk
    assert schedule.answered([8]) == [(2, 8)]
    assert schedule.answered([5]) == [(1, 5)]  # 1's first token: it joins the idle batch 1
    assert describe(schedule.plan()) == [
        (0, 2, (Row(2, 2),), (8,), ()),
        (1, 1, (Row(1, 4),), (5,), ()),
    ]
    assert schedule.sizes() == [1, 1] and schedule.in_flight == 2
    assert schedule.remove([2, 99]) == [2]  # the stages know 2; 99 never existed
    assert schedule.answered([9]) == []  # 2's token was on its way: dropped
    assert schedule.answered([6]) == [(1, 6)]
    assert describe(schedule.plan()) == [(1, 2, (Row(1, 5),), (6,), ())]


def test_schedule_prefills_newcomers_in_turn_and_fills_the_pipe_when_idle() -> None:
    schedule = MicroBatchSchedule(groups=3, prefill_chunk=1, prefill_in_flight=3)
    schedule.add(1, [10, 11, 12, 13])
    schedule.add(2, [20, 21])
    frames = schedule.plan()  # nobody decodes: three chunks, newcomers taking turns
    assert [(frame.rows, frame.tokens, frame.last_chunk) for frame in frames] == [
        ((Row(1, 0),), (10,), False),
        ((Row(2, 0),), (20,), False),
        ((Row(1, 1),), (11,), False),
    ]
    assert schedule.answered([]) == [] and schedule.answered([]) == []
    frames = schedule.plan()  # 2's prompt ends: its last chunk samples
    assert [(frame.rows, frame.tokens, frame.last_chunk) for frame in frames] == [
        ((Row(2, 1),), (21,), True),
        ((Row(1, 2),), (12,), False),
    ]


def test_schedule_restarts_only_without_known_sequences() -> None:
    schedule = MicroBatchSchedule(groups=2, prefill_chunk=4, prefill_in_flight=2)
    schedule.add(1, [1, 2])
    schedule.plan()
    with pytest.raises(ValueError, match="cannot restart"):
        schedule.restart()
    schedule.clear()
    schedule.add(1, [1, 2])
    assert describe(schedule.plan())[0] == (PREFILL_GROUP, 1, (Row(1, 0),), (1, 2), (1,))


# -- loading and the worker contract -------------------------------------------------------------


def test_stages_load_only_their_own_layers(three_stages: Pipeline, five_layer_model: Path) -> None:
    config = json.loads((five_layer_model / "config.json").read_text())
    hidden, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    layer_bytes = 4 * (3 * hidden * hidden + 3 * hidden * inner)  # kv heads = heads / 2
    embedding_bytes = 4 * vocab * hidden
    middle, last = three_stages.workers  # layers [3, 4) and [4, 5) + norm + head
    assert layer_bytes <= middle.peak_memory_bytes < 1.2 * layer_bytes
    assert (
        layer_bytes + embedding_bytes
        <= last.peak_memory_bytes
        < 1.2 * (layer_bytes + embedding_bytes)
    )
    stage = StageModel.load(five_layer_model, range(3, 4), is_last=False)
    assert (stage.embed_tokens, stage.norm, stage.head, len(stage.blocks)) == (None, None, None, 1)


def test_unsupported_model_type_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "granite"}))
    with pytest.raises(EngineError, match="'granite'.*not supported.*scales embeddings"):
        StageModel.load(tmp_path, range(0, 1), is_last=False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layers": [2]}, "invalid field"),
        ({"cluster_key": "abcd"}, "32 bytes"),
        ({"cluster_key": "not a key"}, "neither"),
        ({"next_port": 0}, "invalid ports"),
        ({"layers": [3, 3]}, "empty"),
    ],
)
def test_stage_spec_rejects_bad_fields(change: dict[str, Any], message: str) -> None:
    spec = {
        "model_path": "/m",
        "layers": [0, 2],
        "is_last": False,
        "next_host": HOST,
        "next_port": 9,
        "cluster_key": "00" * 32,
    }
    assert StageSpec.from_json(json.dumps(spec)).layers == range(0, 2)
    with pytest.raises(ConfigError, match=message):
        StageSpec.from_json(json.dumps({**spec, **change}))
    missing = dict(spec)
    del missing["next_host"]
    with pytest.raises(ConfigError, match="next_host"):
        StageSpec.from_json(json.dumps(missing))


def test_worker_reports_failure_on_a_bad_layer_range(
    five_layer_model: Path, tmp_path: Path
) -> None:
    spec = {
        "model_path": str(five_layer_model),
        "layers": [3, 9],
        "is_last": True,
        "next_host": HOST,
        "next_port": 9,
        "cluster_key": generate_key().hex(),
    }
    with open(tmp_path / "stage.log", "ab") as log:
        with pytest.raises(EngineError, match=r"not inside the model's 5 layers"):
            StageProcess.start(spec, stderr=log, ready_timeout_s=60)


def test_strangers_at_the_return_port_do_not_delay_the_chain(
    five_layer_model: Path, cluster_key: bytes, tmp_path: Path
) -> None:
    """The coordinator's return port accepts the last stage while the chain forms: strangers
    already waiting there are proven off that path, and the chain forms as fast as alone."""
    ranges = allocate_layers(5, [1, 1, 1])
    listener, workers = start_workers(five_layer_model, ranges, cluster_key, tmp_path)
    strangers = open_strangers(listener.getsockname()[1], per_kind=8)
    engine = make_engine(five_layer_model, ranges, cluster_key, listener, workers)
    try:
        started = time.monotonic()
        engine.load()
        assert time.monotonic() - started < 5.0  # before: each stranger held it for seconds
        assert len(engine.info().detail["stages"]) == 3
    finally:
        for sock in strangers:
            sock.close()
        engine.close()
        stop_workers(workers)
