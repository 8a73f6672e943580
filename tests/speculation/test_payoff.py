"""A costly drafter that does not pay steps aside: its drafting steps are timed against plain
ones, and drafting pauses (longer each time it loses) when it gives fewer tokens per second."""

from __future__ import annotations

from functools import partial

import pytest
from mlx_lm import load

from engines.decoding.decode_batch import DecodeBatch
from engines.decoding.sampling import greedy
from engines.speculation import lane
from engines.speculation.payoff import EARLY_STEPS, FIRST_PAUSE_STEPS, SAMPLE_STEPS, Payoff
from tests.helpers.scripted_drafter import ScriptedDrafter

PROMPT = "the cat sat on the mat"
TOKENS = 300
MOST_DRAFTED = 4
DRAFTED = 3
SLOW_DRAFT_S = 0.5  # a draft, by the lane's clock: slower than 5 passes of PASS_S
PASS_S = 0.01  # any step, by the lane's clock


class LaneClock:
    """The lane's clock in the decoding test: each step PASS_S, each draft SLOW_DRAFT_S more.
    The real clock made the verdict the machine's load's: on CI's four workers over two cores
    plain steps of the demo model ran ten times slower for stretches, and drafting won."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += PASS_S  # the lane reads it once a step
        return self.now


CLOCK = LaneClock()


def drafting_steps(payoff: Payoff, count: int, seconds: float, tokens: int) -> None:
    """`count` steps of DRAFTED tokens each, `tokens` of them given (accepted + 1)."""
    for _ in range(count):
        assert payoff.allows()
        payoff.record(DRAFTED, seconds, tokens)


def plain_steps(payoff: Payoff, count: int, seconds: float) -> None:
    for _ in range(count):
        payoff.record(0, seconds, 1)


def test_drafting_that_loses_pauses_longer_each_time_and_one_that_wins_goes_on():
    payoff = Payoff()
    payoff.new_sequence()
    # 0.2 s a step could give 20 tok/s with every draft right: no early verdict
    drafting_steps(payoff, 1 + EARLY_STEPS, 0.2, 1)  # the first feeds the prompt: not timed
    assert not payoff.allows()  # no plain rate yet: plain steps are timed
    plain_steps(payoff, SAMPLE_STEPS, 0.1)  # 10 tok/s plain: drafting may still win
    assert payoff.allows()
    drafting_steps(payoff, 1 + SAMPLE_STEPS - EARLY_STEPS, 0.2, 1)  # 5 tok/s over 8: it lost
    assert not payoff.allows()
    plain_steps(payoff, FIRST_PAUSE_STEPS - 1, 0.1)
    assert not payoff.allows()
    plain_steps(payoff, 1, 0.1)
    assert payoff.allows()
    drafting_steps(payoff, 1 + SAMPLE_STEPS, 0.2, 1)  # lost again: the pause doubles
    plain_steps(payoff, 2 * FIRST_PAUSE_STEPS - 1, 0.1)
    assert not payoff.allows()
    plain_steps(payoff, 1, 0.1)
    drafting_steps(payoff, 1 + 4 * SAMPLE_STEPS, 0.2, 4)  # 20 tok/s: it pays, no pause
    assert payoff.allows()


def test_a_try_that_could_not_win_with_every_draft_right_ends_after_early_steps():
    payoff = Payoff()
    payoff.new_sequence()
    # 0.8 s for at most DRAFTED + 1 = 4 tokens: 5 tok/s at best
    drafting_steps(payoff, 1 + EARLY_STEPS, 0.8, 4)
    plain_steps(payoff, SAMPLE_STEPS, 0.1)  # 10 tok/s
    assert not payoff.allows()  # paused at once, without SAMPLE_STEPS drafting steps
    plain_steps(payoff, FIRST_PAUSE_STEPS, 0.1)
    drafting_steps(payoff, 1 + EARLY_STEPS, 0.8, 4)  # the retry is as short: plain is known
    assert not payoff.allows()


def test_one_plain_step_slowed_by_something_else_does_not_make_drafting_win():
    """Plain steps of 10 ms but one of 2 s (a collection, a neighbour's burst): their median,
    100 tok/s, is plain decoding's rate, not the 3.9 tok/s of their total, so a drafter at
    5 tok/s at best is set aside after EARLY_STEPS as it would be without the slow step."""
    payoff = Payoff()
    payoff.new_sequence()
    drafting_steps(payoff, 1 + EARLY_STEPS, 0.8, 4)
    plain_steps(payoff, SAMPLE_STEPS - 1, 0.01)
    plain_steps(payoff, 1, 2.0)
    assert not payoff.allows()


class SlowScriptedDrafter(ScriptedDrafter):
    """Right at every position, and slow to say so (a costly one, as a draft model is)."""

    costly = True

    def wrong(self, position: int, left: int) -> bool:
        return False

    def draft(self, most: int) -> list[int]:
        CLOCK.now += SLOW_DRAFT_S
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


def test_a_costly_drafter_slower_than_plain_decoding_mostly_steps_aside(
    model, monkeypatch: pytest.MonkeyPatch
):
    """Drafting every step would draft ~240 of 300 tokens. Timed, it is tried four times (at
    the start, then after pauses of 32, 64 and 128 plain steps) and left aside between; as it
    is slower even with every draft right, each try ends after EARLY_STEPS timed drafting
    steps, with the one that catches the draft model up before them and the one drafted
    before the verdict after them (51 drafted here; before the early verdict a try took
    SAMPLE_STEPS timed steps: 114)."""
    monkeypatch.setattr(lane, "time", CLOCK)
    plain, _ = decode(*model, SlowScriptedDrafter, None)
    timed, counts = decode(*model, SlowScriptedDrafter, plain)
    assert timed == plain
    assert counts.accepted == counts.drafted > 0
    assert counts.drafted <= 4 * (EARLY_STEPS + 2) * MOST_DRAFTED
