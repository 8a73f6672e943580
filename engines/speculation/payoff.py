"""Whether a costly drafter pays, by the clock: one sequence's tokens per second while drafting
against while decoding plainly. Acceptance alone cannot say it: a draft model that runs slower
than the target (a quantized one on a CPU without quantized kernels) loses even when every guess
is right. Only drafters that run a model are timed: prompt lookup costs nothing beside the pass,
and its decisions must stay a function of the tokens (every tensor-parallel rank drafts alike)."""

from __future__ import annotations

import statistics
from collections import deque

SAMPLE_STEPS = 8  # steps of each kind a verdict is drawn from
# ... but a try ends after this many timed drafting steps when even every draft accepted would
# be slower than plain decoding (a 4-bit draft model on a CPU: ~4x slower at any acceptance)
EARLY_STEPS = 2
FIRST_PAUSE_STEPS = 32  # plain steps after drafting lost, doubled each time it loses again
LONGEST_PAUSE_STEPS = 1024


class Payoff:
    """Drafting is allowed until SAMPLE_STEPS drafting steps are timed (EARLY_STEPS first, when
    no plain rate is known: then SAMPLE_STEPS plain steps are timed too). If drafting gives
    fewer tokens per second than plain decoding, it pauses (the pause doubles after each loss),
    then tries again; a try whose drafting steps would lose even with every draft accepted
    ends after EARLY_STEPS. The first drafting step after a pause is not timed: it feeds the
    draft model what was decoded meanwhile."""

    def __init__(self) -> None:
        # each drafting step: its seconds, its tokens, and its tokens had every draft been right
        self.drafting: deque[tuple[float, int, int]] = deque(maxlen=SAMPLE_STEPS)
        self.plain: deque[tuple[float, int]] = deque(maxlen=SAMPLE_STEPS)
        self.pause_steps = FIRST_PAUSE_STEPS
        self._plain_left = 0  # plain steps to go before drafting is tried again
        self._catching_up = True  # the next drafting step feeds the draft model a backlog
        self._judging = False  # the drafting steps timed wait for plain ones to compare with

    def new_sequence(self) -> None:
        """A sequence arrived: its first draft feeds the draft model its whole prompt."""
        self._catching_up = True

    def allows(self) -> bool:
        return self._plain_left == 0

    def record(self, drafted: int, seconds: float, tokens: int) -> None:
        """One step: the tokens it drafted (0: a plain step), its wall time (step to step) and
        the tokens it gave."""
        if not drafted:
            self.plain.append((seconds, tokens))
            if self._plain_left:
                self._plain_left -= 1
                if self._plain_left == 0 and self._judging:
                    self._judge()
        elif self._catching_up:
            self._catching_up = False
        else:
            self.drafting.append((seconds, tokens, drafted + 1))
            if len(self.drafting) < EARLY_STEPS:
                return
            if len(self.plain) < SAMPLE_STEPS:  # nothing to compare with yet: time plain steps
                self._judging = True
                self._pause(SAMPLE_STEPS - len(self.plain))
            else:
                self._judge()

    def _judge(self) -> None:
        """A loss pauses drafting; a win needs SAMPLE_STEPS drafting steps; before that, only
        a try that could not win even with every draft right is over."""
        self._judging = False
        spent = sum(seconds for seconds, _, _ in self.drafting)
        given = sum(tokens for _, tokens, _ in self.drafting)
        best = sum(most for _, _, most in self.drafting)
        plain = rate(self.plain)
        if best < spent * plain or (len(self.drafting) == SAMPLE_STEPS and given < spent * plain):
            self._pause(self.pause_steps)
            self.pause_steps = min(LONGEST_PAUSE_STEPS, 2 * self.pause_steps)
        elif len(self.drafting) == SAMPLE_STEPS:
            self.pause_steps = FIRST_PAUSE_STEPS
        else:
            return  # no verdict yet: drafting goes on
        self.drafting.clear()

    def _pause(self, steps: int) -> None:
        self._plain_left = steps
        self._catching_up = True


def rate(steps: deque[tuple[float, int]]) -> float:
    """Plain decoding's tokens per second: the median step's, so that a few steps slowed by
    something else (a collection, a neighbour's burst on a shared core) do not make drafting
    look faster than it is."""
    return statistics.median(
        tokens / spent if spent > 0 else float("inf") for spent, tokens in steps
    )
