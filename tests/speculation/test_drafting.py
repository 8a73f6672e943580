"""Prompt lookup and the draft length policy, on their own."""

from __future__ import annotations

from engines.speculation.draft_length import PAUSE_STEPS, DraftLength
from engines.speculation.lane import accepted_prefix
from engines.speculation.prompt_lookup import PromptLookup


def test_a_draft_is_what_followed_the_latest_match_of_the_longest_ngram():
    lookup = PromptLookup([1, 2, 3, 9, 5, 2, 3, 7, 8, 1, 2, 3])
    # "1 2 3" (n=3) was followed by 9 once; "2 3" alone was last followed by 7
    assert lookup.draft(3) == [9, 5, 2]
    lookup.extend([4])
    assert lookup.draft(3) == []  # "3 4", "2 3 4", ... never seen before
    lookup.extend([2, 3])
    assert lookup.draft(2) == [4, 2]  # "4 2 3" is new; "2 3" was last followed by 4
    assert lookup.draft(0) == []


def test_a_draft_never_reads_past_what_is_known():
    lookup = PromptLookup([5, 6, 5, 6])
    assert lookup.draft(8) == [5, 6]  # "5 6" was followed by "5 6", then the end
    assert PromptLookup([5]).draft(4) == []


def test_the_kept_tokens_stop_at_the_first_disagreement():
    assert accepted_prefix([1, 2, 3], [1, 2]) == [1, 2, 3]  # all accepted, and one more
    assert accepted_prefix([1, 9, 3], [1, 2]) == [1, 9]
    assert accepted_prefix([7], []) == [7]


def test_the_draft_length_doubles_is_cut_and_pauses_when_drafts_fail():
    length = DraftLength(most=8)
    assert length.next() == 2
    length.record(2, 2)
    assert length.next() == 4
    length.record(4, 4)
    length.record(8, 8)
    assert length.next() == 8  # never more than `most`
    length.record(8, 1)
    assert length.next() == 2  # what was accepted and one more
    for _ in range(5):  # the running rate falls below the threshold
        length.record(2, 0)
        if length.next() == 0:
            break
    pauses = 1 + sum(length.next() == 0 for _ in range(PAUSE_STEPS))
    assert pauses == PAUSE_STEPS
    assert length.next() >= 1  # then it tries again
