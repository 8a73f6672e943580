"""Sealed, well-formed frames that lie to a live stage: prefix entries and rows it does not
hold, malformed control frames, activations of the wrong shape. Each is refused; the stage
keeps running and serves the next session."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engines.pipeline import wire
from engines.pipeline.sequence_documents import end_frame
from engines.pipeline.wire import PREFILL_GROUP, Frame, Kind, Row
from tests.helpers.live_stage import GREEDY, HIDDEN_SIZE, UPSTREAM, Chain, LiveStage, reject

pytestmark = pytest.mark.cluster


def keep_entry_one(chain: Chain) -> None:
    """Sequence 1 decodes positions 0-1 and is kept as prefix entry 1 (2 tokens)."""
    chain.begin(1)
    for position in (0, 1):
        chain.tokens(chain.decode(0, [Row(1, position)]))
    chain.end([1], keep=[(1, 2)])


# Each attack is sealed and well-formed; what it names does not match what the stage holds.
PREFIX_ATTACKS = {
    "unknown-entry": (
        lambda chain: chain.begin(2, position=1, entry=99),
        "begins from prefix entry 99, not held here",
    ),
    "evicted-entry": (
        lambda chain: (keep_entry_one(chain), chain.end([], evict=[1]), chain.begin(2, 1, 1)),
        "begins from prefix entry 1, not held here",
    ),
    "longer-than-the-entry": (
        lambda chain: (keep_entry_one(chain), chain.begin(2, position=5, entry=1)),
        "holds 2 tokens, asked for 5",
    ),
    "position-without-entry": (
        lambda chain: chain.begin(2, position=3),
        "begins at 3 without a prefix entry",
    ),
    "entry-id-not-a-number": (
        lambda chain: chain.begin(2, position=1, entry="1"),
        "is not an entry id",
    ),
    "keep-the-wrong-length": (
        lambda chain: (
            chain.begin(1),
            chain.tokens(chain.decode(0, [Row(1, 0)])),
            chain.end([1], keep=[(1, 5)]),
        ),
        "keep sequence 1 of 5 tokens: this stage holds 1",
    ),
    "keep-a-sequence-not-ended": (
        lambda chain: (chain.begin(1), chain.end([1], keep=[(2, 1)])),
        "END keeps sequence 2, which the frame does not end",
    ),
    "keep-twice": (
        lambda chain: (
            keep_entry_one(chain),
            chain.begin(1),
            chain.tokens(chain.decode(0, [Row(1, 0)])),
            chain.tokens(chain.decode(0, [Row(1, 1)])),
            chain.end([1], keep=[(1, 2)]),
        ),
        "prefix entry 1 exists already",
    ),
    "share-the-wrong-length": (
        lambda chain: (
            chain.begin(1),
            chain.tokens(chain.decode(0, [Row(1, 0)])),
            chain.send(end_frame(chain.take(), [], share=[(1, 9, 3)])),
        ),
        "keep sequence 1 of 3 tokens: this stage holds 1",
    ),
    "share-as-an-existing-entry": (
        lambda chain: (
            keep_entry_one(chain),
            chain.begin(2),
            chain.tokens(chain.decode(0, [Row(2, 0)])),
            chain.send(end_frame(chain.take(), [], share=[(2, 1, 1)])),
        ),
        "prefix entry 1 exists already",
    ),
}


@pytest.mark.parametrize("name", list(PREFIX_ATTACKS))
def test_prefix_entries_that_do_not_match_the_stage(
    stage: LiveStage, chain: Chain, name: str
) -> None:
    attack, logged = PREFIX_ATTACKS[name]
    reject(stage, chain, lambda: attack(chain), logged)


# then the sealed, well-formed frame below arrives: its rows lie about what the stage holds.
ROW_ATTACKS = {
    "flipped-uid": (
        0,
        2,
        [Row(3, 1)],
        "holds sequences \\[1\\] here, the frame's rows are \\[3\\]",
    ),
    "flipped-newcomer": (0, 2, [Row(1, 1), Row(3, 0)], "row 3 of micro-batch 0 is neither"),
    "swapped-member": (0, 2, [Row(2, 0), Row(1, 1)], "holds sequences \\[1\\] here"),
    "member-left-out": (0, 2, [Row(2, 0)], "holds sequences \\[1\\] here"),
    "replayed-step": (0, 1, [Row(1, 1)], "sent step 1, expected step 2"),
    "skipped-step": (0, 3, [Row(1, 1)], "sent step 3, expected step 2"),
    "stale-position": (0, 2, [Row(1, 0)], "holds 1 tokens here, the frame says 0"),
    "future-position": (0, 2, [Row(1, 5)], "holds 1 tokens here, the frame says 5"),
    "other-micro-batch": (1, 1, [Row(1, 1)], "row 1 of micro-batch 1 is neither in it nor"),
    "group-out-of-range": (300, 1, [Row(2, 0)], "micro-batch 300 is out of range"),
    "prefill-of-a-decoder": (PREFILL_GROUP, 1, [Row(1, 1)], "not prefilling here"),
}


@pytest.mark.parametrize("name", list(ROW_ATTACKS))
def test_rows_that_do_not_match_the_stage(stage: LiveStage, chain: Chain, name: str) -> None:
    group, step, rows, logged = ROW_ATTACKS[name]

    def attack() -> None:
        chain.begin(1)
        chain.begin(2)
        chain.tokens(chain.decode(0, [Row(1, 0)]))
        chain.decode(group, rows, step=step)

    reject(stage, chain, attack, logged)


def test_a_sequence_cannot_begin_twice(stage: LiveStage, chain: Chain) -> None:
    reject(stage, chain, lambda: (chain.begin(1), chain.begin(1)), "sequence 1 began twice")


def test_an_ended_sequence_cannot_decode(stage: LiveStage, chain: Chain) -> None:
    def attack() -> None:
        chain.begin(1)
        chain.tokens(chain.decode(0, [Row(1, 0)]))
        chain.end([1])
        chain.decode(0, [Row(1, 1)])

    reject(stage, chain, attack, "row 1 of micro-batch 0 is neither in it nor")


def begin_with_grammar(grammar: object) -> Frame:
    document = {**GREEDY, "grammar": grammar}
    return wire.document_frame(Kind.BEGIN, 1, document, [Row(1, 0)])


@pytest.mark.parametrize(
    ("frame", "logged"),
    [
        (Frame(Kind.BEGIN, 1, rows=(Row(1, 0),), body=b"{not json"), "not UTF-8 JSON"),
        (Frame(Kind.BEGIN, 1, rows=(Row(1, 0),), body=b'{"temperature": 0}'), "malformed BEGIN"),
        (Frame(Kind.BEGIN, 1, body=b"{}"), "BEGIN frame has no rows"),
        (begin_with_grammar(123), "grammar must be null or a non-empty text, got 123"),
        (begin_with_grammar(""), "grammar must be null or a non-empty text, got ''"),
        (begin_with_grammar(["start: a"]), "grammar must be null or a non-empty text"),
        (
            wire.token_frame(1, 0, 1, [Row(1, 0)], [5]),
            "expected a BEGIN or HIDDEN or END or STATUS",
        ),
        (Frame(Kind.READY, 1, body=b"{}"), "expected a BEGIN or HIDDEN or END or STATUS"),
        (Frame(Kind.END, 1, 2, 3, (Row(1, 0),)), "END frame carries a group or step"),
        (Frame(Kind.END, 1, rows=(Row(1, 0), Row(1, 0))), "lists a uid twice"),
        (Frame(Kind.END, 1, rows=(Row(1, 0),)), "END frame body is not UTF-8 JSON"),
        (
            Frame(Kind.END, 1, rows=(Row(1, 0),), body=b'{"keep": [[1, true]]}'),
            "malformed keep item",
        ),
        (Frame(Kind.END, 1, body=b'{"evict": [-1]}'), "evict must list entry ids"),
        (Frame(Kind.END, 1, body=b'{"spill": [1.5]}'), "spill must list entry ids"),
        (Frame(Kind.STATUS, 1, body=b'{"reports": [{}], "load": {}}'), "STATUS load must"),
        (
            wire.hidden_frame(1, 0, 1, [Row(1, 0)], mx.zeros((1, 1, HIDDEN_SIZE)), flags=4),
            "HIDDEN frame of group 0 flags a prompt's last chunk",
        ),
    ],
    ids=[
        "json",
        "fields",
        "rowless",
        "grammar-number",
        "grammar-empty",
        "grammar-list",
        "token-downstream",
        "ready-downstream",
        "end-step",
        "twice",
        "end-without-document",
        "end-keeps-a-boolean",
        "end-evicts-a-negative-id",
        "end-spills-a-fraction",
        "status-loads-an-object",
        "decode-flagged-last-chunk",
    ],
)
def test_malformed_control_frames(
    stage: LiveStage, chain: Chain, frame: Frame, logged: str
) -> None:
    def attack() -> None:  # sealed as a frame down the chain, whatever its kind
        chain.out.send(wire.encode(frame), wire.associated_data(frame.number, UPSTREAM))

    reject(stage, chain, attack, logged)


@pytest.mark.parametrize(
    ("shape", "rows", "group", "logged"),
    [
        ((1, 1, HIDDEN_SIZE - 1), [Row(1, 0)], 0, "activation width 255"),
        ((2, 1, HIDDEN_SIZE), [Row(1, 0)], 0, "not \\(B, L, D\\) with B = 1 rows"),
        ((1, 2, HIDDEN_SIZE), [Row(1, 0)], 0, "one token per row, this one 2"),
        ((2, 1, HIDDEN_SIZE), [Row(1, 0), Row(2, 0)], PREFILL_GROUP, "one sequence, this one 2"),
    ],
    ids=["width", "rows-vs-batch", "decode-of-two-tokens", "prefill-of-two-sequences"],
)
def test_activation_of_the_wrong_shape(
    stage: LiveStage,
    chain: Chain,
    shape: tuple[int, ...],
    rows: list[Row],
    group: int,
    logged: str,
) -> None:
    def attack() -> None:
        chain.begin(1)
        chain.begin(2)
        hidden = mx.zeros(shape, dtype=mx.float32)
        chain.send(wire.hidden_frame(chain.take(), group, 1, rows, hidden))

    reject(stage, chain, attack, logged)
