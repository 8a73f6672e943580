"""A costly drafter that does not pay steps aside: its drafting steps are timed against plain
ones, and drafting pauses (longer each time it loses) when it gives fewer tokens per second."""

from __future__ import annotations

import time
from functools import partial

import pytest
from mlx_lm import load

from engines.decoding.decode_batch import DecodeBatch
from engines.decoding.sampling import greedy
from engines.speculation.payoff import FIRST_PAUSE_STEPS, SAMPLE_STEPS, Payoff
from tests.helpers.scripted_drafter import ScriptedDrafter

PROMPT = "the cat sat on the mat"
TOKENS = 300
MOST_DRAFTED = 4
SLOW_DRAFT_S = 0.15  # far slower than a demo model's pass: drafting loses even when right


def drafting_steps(payoff: Payoff, count: int, seconds: float, tokens: int) -> None:
    for _ in range(count):
        assert payoff.allows()
        payoff.record(True, seconds, tokens)


def plain_steps(payoff: Payoff, count: int, seconds: float) -> None:
    for _ in range(count):
        payoff.record(False, seconds, 1)


def test_drafting_that_loses_pauses_longer_each_time_and_one_that_wins_goes_on():
    payoff = Payoff()
    payoff.new_sequence()
    drafting_steps(payoff, 1 + SAMPLE_STEPS, 0.5, 4)  # the first feeds the prompt: not timed
    assert not payoff.allows()  # no plain rate yet: plain steps are timed
    plain_steps(payoff, SAMPLE_STEPS, 0.1)  # 10 tok/s plain against 8 drafting: it lost
    assert not payoff.allows()
    plain_steps(payoff, FIRST_PAUSE_STEPS - 1, 0.1)
    assert not payoff.allows()
    plain_steps(payoff, 1, 0.1)
    assert payoff.allows()
    drafting_steps(payoff, 1 + SAMPLE_STEPS, 0.5, 4)  # lost again: the pause doubles
    plain_steps(payoff, 2 * FIRST_PAUSE_STEPS - 1, 0.1)
    assert not payoff.allows()
    plain_steps(payoff, 1, 0.1)
    drafting_steps(payoff, 1 + 4 * SAMPLE_STEPS, 0.2, 4)  # 20 tok/s: it pays, no pause
    assert payoff.allows()


class SlowScriptedDrafter(ScriptedDrafter):
    """Right at every position, and slow to say so (a costly one, as a draft model is)."""

    costly = True

    def wrong(self, position: int, left: int) -> bool:
        return False

    def draft(self, most: int) -> list[int]:
        time.sleep(SLOW_DRAFT_S)
        return super().draft(most)


def decode(model, tokenizer, drafter: type[ScriptedDrafter], plain: list[int] | None):
    prompt = tokenizer.encode(PROMPT)
    script = partial(drafter, prompt + (plain or []))
    batch = DecodeBatch(model, 8, 64, most_drafted=MOST_DRAFTED if plain else 0, drafter=script)
    batch.insert(0, prompt, greedy, [])
    tokens = []
    while len(tokens) < TOKENS:
        tokens += [output.token for output in batch.step()]
    counts = batch.speculation()
    batch.close()
    return tokens[:TOKENS], counts


@pytest.fixture(scope="module")
def model(demo_model_dir):
    return load(str(demo_model_dir))


def test_a_costly_drafter_slower_than_plain_decoding_mostly_steps_aside(model):
    """Drafting every step would draft ~240 of 300 tokens; timed, it is tried three times (at
    the start, then after pauses of 32 and 64 plain steps) and left aside between. Each try is
    SAMPLE_STEPS timed drafting steps, the one that catches the draft model up before them,
    and the one drafted before the verdict after them."""
    plain, _ = decode(*model, SlowScriptedDrafter, None)
    timed, counts = decode(*model, SlowScriptedDrafter, plain)
    assert timed == plain
    assert counts.accepted == counts.drafted > 0
    assert counts.drafted <= 3 * (SAMPLE_STEPS + 2) * MOST_DRAFTED
