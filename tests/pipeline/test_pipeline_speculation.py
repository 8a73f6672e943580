"""Prompt-lookup speculation over a two-stage pipeline: a sequence decoding alone verifies a
draft in one trip down the chain and gets plain decoding's tokens, greedy or seeded; a request
arriving meanwhile, a stop inside a verified draft and a prefix-cache entry kept right after
a verifying pass all come out as without speculation."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest

from engines.core.request import GenerationRequest
from engines.pipeline.batches import StageBatches
from engines.pipeline.speculation import PipelineSpeculation
from engines.pipeline.stage_model import StageModel
from engines.pipeline.wire import Row, WireError
from planner import allocate_layers
from tests.helpers.pipeline import (
    Outcome,
    Pipeline,
    assert_same,
    collect,
    make_request,
    open_pipeline,
    run,
)
from tests.helpers.scripted_drafter import ScriptBook, ScriptedDrafter, WrongLastDrafter

pytestmark = pytest.mark.cluster

PROMPT = "the cat sat on the mat. the cat sat on the"
MOST_DRAFTED = 4
CACHE_BYTES = 64 * 1024 * 1024


@pytest.fixture(scope="module")
def book() -> ScriptBook:
    return ScriptBook()


@pytest.fixture(scope="module")
def speculating(
    demo_model_dir: Path,
    cluster_key: bytes,
    book: ScriptBook,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Pipeline]:
    """The demo model on two stages, drafting from `book`, with a prefix cache; one
    micro-batch, so that a newcomer joins the speculating sequence's."""
    yield from open_pipeline(
        demo_model_dir, allocate_layers(4, [8, 8]), cluster_key,
        tmp_path_factory.mktemp("speculation"), most_drafted=MOST_DRAFTED, drafter=book,
        prefix_cache_bytes=CACHE_BYTES, micro_batches=1,
    )  # fmt: skip


def counts(pipeline: Pipeline) -> dict[str, int]:
    return dict(pipeline.engine.info().detail["speculation"])


def learned(pipeline: Pipeline, book: ScriptBook, request: GenerationRequest) -> Outcome:
    """Plain decoding's outcome (the single engine's, which the pipeline's equals), learned
    as the script the request drafts from."""
    plain = run(pipeline.reference, request)
    book.learn(request.prompt_tokens, plain.tokens)
    return plain


def assert_speculated(before: dict[str, int], after: dict[str, int]) -> None:
    """Drafts were both accepted and rejected, several tokens per pass."""
    accepted = after["accepted"] - before["accepted"]
    drafted = after["drafted"] - before["drafted"]
    assert 0 < accepted < drafted


def test_greedy_tokens_are_plain_decoding_s(speculating: Pipeline, book: ScriptBook) -> None:
    request = make_request(speculating.runner, PROMPT, max_tokens=48)
    learned(speculating, book, request)
    before = counts(speculating)
    assert_same(speculating, request)
    after = counts(speculating)
    assert_speculated(before, after)
    assert after["most_drafted"] == MOST_DRAFTED
    assert after["steps"] - before["steps"] < 40  # fewer trips than tokens


def test_seeded_sampling_draws_the_same_tokens(speculating: Pipeline, book: ScriptBook) -> None:
    request = make_request(
        speculating.runner, PROMPT, max_tokens=48, temperature=0.9, top_p=0.95, seed=7
    )
    plain = learned(speculating, book, request)
    before = counts(speculating)
    assert_same(speculating, request)
    assert_speculated(before, counts(speculating))
    greedy = run(speculating.reference, make_request(speculating.runner, PROMPT, max_tokens=48))
    assert plain.tokens != greedy.tokens  # it sampled


def test_a_request_arriving_meanwhile_gets_its_tokens(
    speculating: Pipeline, book: ScriptBook
) -> None:
    """A newcomer while one speculates: the first decodes plainly beside it (its rejected
    positions trimmed first), then speculates again once alone; both get their own tokens."""
    runner = speculating.runner
    first = make_request(runner, PROMPT, max_tokens=60, temperature=0.7, seed=3)
    second = make_request(runner, "Once upon a time", max_tokens=12, seed=5, temperature=1.0)
    expected = [learned(speculating, book, request) for request in (first, second)]
    before = counts(speculating)

    async def overlap() -> list[Outcome]:
        tokens: list[int] = []
        joining = None
        async for event in runner.submit(first).events():
            if event.token is not None:
                tokens.append(event.token)
            if joining is None and len(tokens) >= 8:  # it is speculating by now
                joining = asyncio.create_task(collect(runner, second))
            if event.finish_reason is not None:
                outcome = Outcome(
                    tokens, "", event.finish_reason, event.error, event.completion_tokens
                )
                return [outcome, await joining]
        raise AssertionError("the event stream ended without a final event")

    outcomes = asyncio.run(asyncio.wait_for(overlap(), timeout=90))
    for outcome, plain in zip(outcomes, expected, strict=True):
        assert (outcome.tokens, outcome.finish) == (plain.tokens, plain.finish)
    assert_speculated(before, counts(speculating))


def test_max_tokens_ends_exactly(speculating: Pipeline, book: ScriptBook) -> None:
    """Drafts leave room for max_tokens: the last tokens come as without speculation."""
    for max_tokens in (2, 5, 7):
        request = make_request(speculating.runner, PROMPT + " mat", max_tokens=max_tokens)
        learned(speculating, book, request)
        outcome = assert_same(speculating, request)
        assert (outcome.completion_tokens, outcome.finish) == (max_tokens, "length")


def test_a_stop_inside_a_verified_draft_and_its_kept_entry(
    speculating: Pipeline, book: ScriptBook
) -> None:
    """Every pass rejects its draft's last guess, so the pass that reaches the stop word
    leaves a rejected position on the stages: the END that keeps the sequence trims it first.
    The next turn hits that entry and gets plain decoding's tokens."""
    runner = speculating.runner
    whole = make_request(runner, "A cat sat. A cat sat. A cat", max_tokens=40)
    stop_word = learned(speculating, book, whole).text.split()[4]
    first = make_request(runner, "A cat sat. A cat sat. A cat", max_tokens=40, stop=(stop_word,))
    book.drafter = WrongLastDrafter
    try:
        before = counts(speculating)
        answer = assert_same(speculating, first)
        assert counts(speculating)["drafted"] > before["drafted"]
    finally:
        book.drafter = ScriptedDrafter
    assert answer.finish == "stop"
    prompt = (*first.prompt_tokens, *answer.tokens, *runner.engine.tokenizer.encode(" And?"))
    second = GenerationRequest("second-turn", prompt, max_tokens=12)
    hits = speculating.engine.prefix_index.snapshot()["hits"]
    assert_same(speculating, second)
    assert speculating.engine.prefix_index.snapshot()["hits"] > hits


def test_what_never_speculates(whole_model: StageModel) -> None:
    """Requests the last stage scores, quantized KV, and sliding windows anywhere."""
    caches = whole_model.make_cache()
    plain = GenerationRequest("p", (1, 2, 1, 2), 32)
    script = [1, 2, 1, 2, 1, 2, 1, 2]
    speculation = PipelineSpeculation(4, lambda tokens: ScriptedDrafter(script, tokens))
    speculation.check_model(caches, (None,) * 4, kv_bits=0)
    assert speculation.draft(1, plain, plain.prompt_tokens, room=8)
    scored = ({"logprobs": 0}, {"repetition_penalty": 1.2}, {"presence_penalty": 0.5})
    for uid, options in enumerate(scored, start=2):
        request = GenerationRequest("s", plain.prompt_tokens, 32, **options)
        assert speculation.draft(uid, request, request.prompt_tokens, room=8) == []
    assert speculation.draft(1, plain, plain.prompt_tokens, room=0) == []
    for windows, kv_bits in (((None, 16, None, 16), 0), ((None,) * 4, 8)):
        off = PipelineSpeculation(4)
        off.check_model(caches, windows, kv_bits)
        assert not off.possible and off.draft(1, plain, plain.prompt_tokens, room=8) == []


# -- a stage's caches going back ----------------------------------------------------------------


@pytest.fixture(scope="module")
def whole_model(demo_model_dir: Path) -> StageModel:
    return StageModel.load(demo_model_dir, range(0, 4), True)


def fed(stage: StageModel, tokens: list[int]) -> mx.array:
    return stage.embed(mx.array([tokens], dtype=mx.uint32))


def test_a_lone_sequence_goes_back_to_plain_decoding_s_caches(whole_model: StageModel) -> None:
    """A verifying pass of three positions, one rejected: trimmed, the caches give the next
    position what plain decoding's do; an END may keep it behind what it holds (minus what
    the last pass rejected)."""
    stage, prompt = whole_model, [5, 9, 2, 7]
    batches = StageBatches(stage)
    for uid in (1, 2):
        batches.begin(uid)
        batches.prefill(Row(uid, 0), fed(stage, prompt))
    batches.decode(0, [Row(1, 4)], fed(stage, [11, 12, 13]))  # a draft of two
    batches.decode(1, [Row(2, 4)], fed(stage, [11]))
    batches.decode(1, [Row(2, 5)], fed(stage, [12]))
    assert batches.roll_back(0, [Row(1, 6)]) == {1: 1}
    speculated = batches.decode(0, [Row(1, 6)], fed(stage, [20]))
    plain = batches.decode(1, [Row(2, 6)], fed(stage, [20]))
    assert mx.allclose(speculated, plain, atol=1e-4).item()
    batches.decode(0, [Row(1, 7)], fed(stage, [21, 22]))
    assert batches.keep(1, 8) > 0  # ended right after verifying: its rejected position goes
    caches, _ = batches.prefix._entries[1]
    assert {cache.offset for cache in caches} == {8}


def test_positions_go_back_only_after_a_verifying_pass(whole_model: StageModel) -> None:
    """Not in a micro-batch of several, nor further than the positions drafted."""
    stage = whole_model
    batches = StageBatches(stage)
    for uid in (1, 2):
        batches.begin(uid)
        batches.prefill(Row(uid, 0), fed(stage, [3, 4, 5]))
    batches.decode(0, [Row(1, 3), Row(2, 3)], stage.embed(mx.array([[6], [7]], dtype=mx.uint32)))
    assert batches.roll_back(0, [Row(1, 2), Row(2, 2)]) == {}
    with pytest.raises(WireError):
        batches.decode(0, [Row(1, 2), Row(2, 2)], stage.embed(mx.array([[6], [7]])))
    with pytest.raises(WireError):
        batches.keep(1, 3)
    with pytest.raises(WireError):  # a verifying pass is one sequence's
        batches.decode(0, [Row(1, 4), Row(2, 4)], stage.embed(mx.array([[8, 9], [8, 9]])))
    batches.begin(3)
    batches.prefill(Row(3, 0), fed(stage, [3, 4, 5]))
    batches.decode(1, [Row(3, 3)], fed(stage, [6, 7, 8]))  # two drafted: at most two go back
    assert batches.roll_back(1, [Row(3, 3)]) == {}
    with pytest.raises(WireError):
        batches.decode(1, [Row(3, 3)], fed(stage, [6]))
