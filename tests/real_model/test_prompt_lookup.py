"""Prompt-lookup speculation on the real model, through the runner as the API drives it: a
request that copies its prompt gets the tokens of plain decoding in fewer passes, and every
way a request ends or is joined by others works while it speculates."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.core.engine_options import EngineOptions
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.single.engine import SingleEngine
from tests.helpers.api import MODEL_ID, make_service, open_client
from tests.helpers.engine import Outcome, collect, run_one

PARAGRAPH = (
    "Sphinx of black quartz, judge my vow. The five boxing wizards jump quickly. "
    "Pack my box with five dozen liquor jugs."
)
COPY = f"Repeat this text exactly, nothing else:\n\n{PARAGRAPH}"
FREE = "Name a colour."
TOKENS = 40
PREFIX_CACHE_BYTES = 64 * 1024**2


def start(model_dir: Path, most_drafted: int) -> EngineRunner:
    engine = SingleEngine(
        model_dir, EngineOptions(prefix_cache_bytes=PREFIX_CACHE_BYTES, most_drafted=most_drafted)
    )
    runner = EngineRunner(engine, queue_size=8, max_batch=4)
    runner.start(load_timeout_s=120)
    return runner


@pytest.fixture(scope="module")
def runners(smollm2_dir: Path) -> Iterator[tuple[EngineRunner, EngineRunner]]:
    """(plain, speculating) engines on the same weights."""
    plain, speculating = start(smollm2_dir, 0), start(smollm2_dir, 4)
    yield plain, speculating
    plain.close()
    speculating.close()


def chat(runner: EngineRunner, text: str, max_tokens: int = TOKENS, **options) -> GenerationRequest:
    tokenizer = runner.engine.tokenizer
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    return GenerationRequest(f"r-{text[:6]}", tuple(ids), max_tokens, **options)


def counts(runner: EngineRunner) -> dict[str, int]:
    return dict(runner.engine.info().detail["speculation"])


def test_a_copying_answer_is_plain_decoding_in_fewer_passes(runners):
    plain, speculating = runners
    expected = run_one(plain, chat(plain, COPY))
    before = counts(speculating)
    got = run_one(speculating, chat(speculating, COPY))
    after = counts(speculating)
    assert (got.tokens, got.text, got.finish) == (expected.tokens, expected.text, expected.finish)
    assert "boxing wizards" in got.text  # it copies: the drafts had something to match
    accepted = after["accepted"] - before["accepted"]
    assert accepted >= len(got.tokens) // 3
    # the request's own counts, as its usage and log line give them
    assert (got.accepted_tokens, got.drafted_tokens) == (
        accepted,
        after["drafted"] - before["drafted"],
    )
    assert after["steps"] - before["steps"] <= len(got.tokens) - accepted
    assert "speculation" not in plain.engine.info().detail


def test_max_tokens_and_stop_strings_end_inside_a_verified_draft(runners):
    plain, speculating = runners
    whole = run_one(plain, chat(plain, COPY))
    stop = whole.text[whole.text.index("boxing") :][:6]  # a word the copy reaches mid-draft
    for options in ({"max_tokens": 13}, {"stop": (stop,)}):
        fields = {"max_tokens": TOKENS, **options}
        expected = run_one(plain, chat(plain, COPY, **fields))
        got = run_one(speculating, chat(speculating, COPY, **fields))
        assert (got.tokens, got.text, got.finish) == (
            expected.tokens,
            expected.text,
            expected.finish,
        )
        assert got.completion_tokens == expected.completion_tokens
    assert stop not in got.text and got.finish == "stop"


def test_a_request_arriving_mid_draft_joins_and_both_answer_as_alone(runners):
    """The lone speculating request goes back into the batch when a second one arrives."""
    plain, speculating = runners
    alone = [run_one(plain, chat(plain, text)) for text in (COPY, FREE)]
    before = counts(speculating)

    async def staggered() -> list[Outcome]:
        first = asyncio.create_task(collect(speculating, chat(speculating, COPY)))
        while counts(speculating)["accepted"] == before["accepted"]:  # it speculates
            await asyncio.sleep(0.005)
        second = await collect(speculating, chat(speculating, FREE))
        return [await first, second]

    together = asyncio.run(asyncio.wait_for(staggered(), 120))
    assert [o.tokens for o in together] == [o.tokens for o in alone]
    assert len(together[0].tokens) > counts(speculating)["accepted"] - before["accepted"]


def test_a_prefix_cache_hit_after_a_speculated_answer_reuses_what_it_kept(runners):
    """The answer's KV, trimmed of rejected drafts, is kept for the next turn: a follow-up
    reuses it and answers as plain decoding does."""
    plain, speculating = runners
    first = run_one(speculating, chat(speculating, COPY))
    follow_up = [
        {"role": "user", "content": COPY},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Now repeat it once more."},
    ]
    answers = []
    for runner in (plain, speculating):
        ids = runner.engine.tokenizer.apply_chat_template(follow_up, add_generation_prompt=True)
        answers.append(run_one(runner, GenerationRequest("f", tuple(ids), TOKENS)))
    assert answers[1].tokens == answers[0].tokens
    assert answers[1].cached_tokens > len(first.tokens)  # the speculated answer was reused


@pytest.mark.anyio
async def test_the_usage_counts_the_accepted_and_rejected_drafts(runners):
    """OpenAI's completion_tokens_details prediction counts carry the request's drafts."""
    _, speculating = runners
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": COPY}],
        "temperature": 0,
        "max_tokens": TOKENS,
    }
    async with open_client(make_service(speculating)) as client:
        reply = await client.post("/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    details = reply.json()["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] >= TOKENS // 4, details
    assert details["rejected_prediction_tokens"] >= 0
