"""Drafters for speculation tests: random-weight demo models never repeat themselves, so prompt
lookup would find nothing to draft; these draft plain decoding's own tokens, some wrong."""

from __future__ import annotations

from collections.abc import Sequence

WRONG_EVERY = 3  # the scripted drafter's every third position is a wrong guess


class ScriptedDrafter:
    """Drafts what plain decoding wrote, wrong at every WRONG_EVERY-th position: drafts are
    accepted and rejected."""

    costly = False

    def __init__(self, script: Sequence[int], tokens: Sequence[int]) -> None:
        self.script = list(script)
        self.known = len(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self.known += len(tokens)

    def draft(self, most: int) -> list[int]:
        guesses = self.script[self.known : self.known + most]
        return [
            token + 1 if self.wrong(self.known + i, len(guesses) - i) else token
            for i, token in enumerate(guesses)
        ]

    def wrong(self, position: int, left: int) -> bool:
        """Whether the guess at `position` (with `left` guesses from it to the draft's end)
        is made wrong."""
        return position % WRONG_EVERY == 0


class WrongLastDrafter(ScriptedDrafter):
    """Every draft's last guess is wrong: every verifying pass rejects a position."""

    def wrong(self, position: int, left: int) -> bool:
        return left == 1


class ScriptBook:
    """A drafter factory for an engine serving several requests: a sequence whose tokens
    begin a script learned (the latest first) drafts it; any other drafts nothing."""

    def __init__(self, drafter: type[ScriptedDrafter] = ScriptedDrafter) -> None:
        self.drafter = drafter
        self.scripts: list[list[int]] = []

    def learn(self, prompt: Sequence[int], plain: Sequence[int]) -> None:
        self.scripts.append([*prompt, *plain])

    def __call__(self, tokens: list[int]) -> ScriptedDrafter:
        for script in reversed(self.scripts):
            if script[: len(tokens)] == tokens:
                return self.drafter(script, tokens)
        return self.drafter([], tokens)
