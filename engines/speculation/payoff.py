"""Whether a costly drafter pays, by the clock: one sequence's tokens per second while drafting
against while decoding plainly. Acceptance alone cannot say it: a draft model that runs slower
than the target (a quantized one on a CPU without quantized kernels) loses even when every guess
is right. Only drafters that run a model are timed: prompt lookup costs nothing beside the pass,
and its decisions must stay a function of the tokens (every tensor-parallel rank drafts alike)."""

from __future__ import annotations

from collections import deque

SAMPLE_STEPS = 8  # steps of each kind a verdict is drawn from
FIRST_PAUSE_STEPS = 32  # plain steps after drafting lost, doubled each time it loses again
LONGEST_PAUSE_STEPS = 1024


class Payoff:
    """Drafting is allowed until SAMPLE_STEPS drafting steps are timed; then, when no plain rate
    is known, SAMPLE_STEPS plain steps are timed too. If drafting gives fewer tokens per second
    than plain decoding, it pauses (the pause doubles after each loss), then tries again. The
    first drafting step after a pause is not timed: it feeds the draft model what was decoded
    meanwhile."""

    def __init__(self) -> None:
        self.drafting: deque[tuple[float, int]] = deque(maxlen=SAMPLE_STEPS)
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

    def record(self, drafted: bool, seconds: float, tokens: int) -> None:
        """One step: whether it drafted, its wall time (step to step) and the tokens it gave."""
        if not drafted:
            self.plain.append((seconds, tokens))
            if self._plain_left:
                self._plain_left -= 1
                if self._plain_left == 0 and self._judging:
                    self._judge()
        elif self._catching_up:
            self._catching_up = False
        else:
            self.drafting.append((seconds, tokens))
            if len(self.drafting) < SAMPLE_STEPS:
                return
            if len(self.plain) < SAMPLE_STEPS:  # nothing to compare with yet: time plain steps
                self._judging = True
                self._pause(SAMPLE_STEPS - len(self.plain))
            else:
                self._judge()

    def _judge(self) -> None:
        self._judging = False
        if rate(self.drafting) < rate(self.plain):
            self._pause(self.pause_steps)
            self.pause_steps = min(LONGEST_PAUSE_STEPS, 2 * self.pause_steps)
        else:
            self.pause_steps = FIRST_PAUSE_STEPS
        self.drafting.clear()

    def _pause(self, steps: int) -> None:
        self._plain_left = steps
        self._catching_up = True


def rate(steps: deque[tuple[float, int]]) -> float:
    seconds = sum(spent for spent, _ in steps)
    return sum(tokens for _, tokens in steps) / seconds if seconds > 0 else float("inf")
