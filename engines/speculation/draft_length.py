"""How many tokens a sequence drafts next, from how its earlier drafts fared: speculation that
does not pay steps aside."""

from __future__ import annotations

START_LENGTH = 2
AVERAGING = 0.25  # weight of the newest draft in the running acceptance rate
LOW_ACCEPTANCE = 0.3  # below this the extra positions cost more than they save ...
PAUSE_STEPS = 16  # ... so the sequence decodes plainly this many steps before trying again


class DraftLength:
    """The next draft's length: it doubles after a draft accepted whole, and is cut to what
    was accepted and one more after a rejection; while the running acceptance rate is low, no
    drafts for PAUSE_STEPS steps."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.length = min(START_LENGTH, most)
        self.rate = 1.0  # running acceptance rate of the drafted tokens
        self._paused = 0

    def next(self) -> int:
        if self._paused:
            self._paused -= 1
            return 0
        return self.length

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.length = min(self.most, self.length * 2)
        else:
            self.length = max(1, min(self.most, accepted + 1))
        self.rate += AVERAGING * (accepted / drafted - self.rate)
        if self.rate < LOW_ACCEPTANCE:
            self._paused = PAUSE_STEPS
            self.rate = 2 * LOW_ACCEPTANCE  # one good draft after the pause earns another try
