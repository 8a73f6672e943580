"""Stop sequences on streamed text: hold back what could still become a stop string."""

from __future__ import annotations


class StopTextFilter:
    """Feed text deltas; get back what is safe to emit and the stop string that matched."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Return (text safe to emit now, the stop string found or None).

        When two stop strings match, the one that starts first wins (the longer at a tie).
        """
        if not self._stops:
            return delta, None
        self._held += delta
        found = [(self._held.find(stop), -len(stop), stop) for stop in self._stops]
        matches = sorted(match for match in found if match[0] >= 0)
        if matches:
            cut, _, stop = matches[0]
            text, self._held = self._held[:cut], ""
            return text, stop
        keep = self._longest_stop_prefix_suffix()
        text = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        return text, None

    def flush(self) -> str:
        """The held-back text, once the generation ended without a stop string."""
        text, self._held = self._held, ""
        return text

    def _longest_stop_prefix_suffix(self) -> int:
        # The longest tail of the held text that is a proper prefix of some stop string.
        best = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(self._held)), best, -1):
                if self._held.endswith(stop[:size]):
                    best = size
                    break
        return best
