"""StopTextFilter: what is held back, and which stop string ended the text."""

from __future__ import annotations

import pytest

from engines.core.stop_text import StopTextFilter


@pytest.mark.parametrize(
    ("stops", "deltas", "emitted", "matched"),
    [
        (("END",), ["abc", "E", "N", "D", "x"], "abc", "END"),
        (("END",), ["abc", "E", "N", "x"], "abcENx", None),
        (("lo", "hello"), ["say hel", "lo"], "say ", "hello"),  # the earlier start wins
        (("b", "ab"), ["xab"], "x", "ab"),
        (("ab", "a"), ["xab"], "x", "ab"),  # same start: the longer
    ],
)
def test_the_matched_stop_string_is_named(
    stops: tuple[str, ...], deltas: list[str], emitted: str, matched: str | None
) -> None:
    stop_filter = StopTextFilter(stops)
    text, found = "", None
    for delta in deltas:
        piece, found = stop_filter.feed(delta)
        text += piece
        if found is not None:
            break
    else:
        text += stop_filter.flush()
    assert (text, found) == (emitted, matched)
