"""A live last stage, the test as its coordinator: valid sessions are served exactly, batches,
prefill chunks, prefix entries and grammars row by row."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_tokenizer

from engines.pipeline import wire
from engines.pipeline.wire import PREFILL_GROUP, Frame, Kind, Row
from tests.helpers.live_stage import JSON_OBJECT, UNKNOWN_TOKEN, Chain, LiveStage, activation

pytestmark = pytest.mark.cluster


def test_a_valid_session_is_served_twice_the_same(chain: Chain, baseline: list[int]) -> None:
    assert chain.first_tokens() == baseline
    chain.begin(2)
    assert chain.tokens(chain.decode(0, [Row(2, 0)])) == baseline[:1]  # an empty cache again


def test_a_batch_gives_each_row_its_tokens_alone(chain: Chain, baseline: list[int]) -> None:
    """Three sequences in micro-batches 0 and 1, joining and leaving: each row as alone."""
    for uid in (1, 2, 3):
        chain.begin(uid)
    assert chain.tokens(chain.decode(0, [Row(1, 0), Row(2, 0)])) == [baseline[0]] * 2
    assert chain.tokens(chain.decode(1, [Row(3, 0)])) == baseline[:1]
    chain.end([1])
    assert chain.tokens(chain.decode(0, [Row(2, 1)])) == baseline[1:2]
    chain.begin(4)  # a newcomer joins micro-batch 1 behind its member
    assert chain.tokens(chain.decode(1, [Row(3, 1), Row(4, 0)])) == baseline[1::-1]
    chain.end([2, 3, 4])


def test_prefill_chunks_are_acknowledged_and_fill_the_cache(chain: Chain) -> None:
    """Sequence 1 prefills positions 0-1 in one chunk, sequence 2 decodes them one by one:
    their third token is the same; sequence 3's last chunk, positions 0-2, samples it."""
    chain.begin(1)
    chain.begin(2)
    chain.begin(3)
    number = chain.take()
    hidden = mx.concatenate([activation(0), activation(1)], axis=1)  # (1, 2, D)
    chain.send(wire.hidden_frame(number, PREFILL_GROUP, 1, [Row(1, 0)], hidden))
    ack = Frame(Kind.TOKEN, number, PREFILL_GROUP, 1, (Row(1, 0),))
    assert chain.tokens(ack) == []
    for position in (0, 1):
        chain.tokens(chain.decode(1, [Row(2, position)]))
    third = chain.tokens(chain.decode(1, [Row(2, 2)]))
    assert chain.tokens(chain.decode(0, [Row(1, 2)])) == third
    number = chain.take()
    hidden = mx.concatenate([activation(0), activation(1), activation(2)], axis=1)  # (1, 3, D)
    last = wire.LAST_CHUNK
    chain.send(wire.hidden_frame(number, PREFILL_GROUP, 2, [Row(3, 0)], hidden, flags=last))
    assert chain.tokens(Frame(Kind.TOKEN, number, PREFILL_GROUP, 2, (Row(3, 0),), last)) == third
    # then it decodes like the others, joining micro-batch 0 behind sequence 1
    fourth = chain.tokens(chain.decode(1, [Row(2, 3)]))
    assert chain.tokens(chain.decode(0, [Row(1, 3), Row(3, 3)])) == fourth * 2


def test_a_prefix_entry_starts_sequences_where_it_left_off(
    chain: Chain, baseline: list[int]
) -> None:
    """Sequence 1 decodes positions 0-1 and is kept as entry 1; sequences starting from it
    continue exactly as one that decoded every position itself, and the entry stays intact."""
    chain.begin(9)
    for position in (0, 1):
        chain.tokens(chain.decode(1, [Row(9, position)]))
    reference = chain.tokens(chain.decode(1, [Row(9, 2)]))  # position 2 after 0 and 1
    chain.begin(1)
    assert (
        chain.tokens(chain.decode(0, [Row(1, 0)])) + chain.tokens(chain.decode(0, [Row(1, 1)]))
        == baseline
    )
    chain.end([1, 9], keep=[(1, 2)])
    report = chain.status()
    assert report["prefix_entries"] == 1 and report["prefix_bytes"] > 0
    assert report["active_requests"] == 0
    chain.begin(2, position=2, entry=1)
    chain.begin(3, position=1, entry=1)  # a shorter prefix of the same entry
    assert chain.tokens(chain.decode(0, [Row(2, 2), Row(3, 1)])) == reference + baseline[1:]
    chain.begin(4, position=2, entry=1)  # the entry is intact after two sequences used it
    assert chain.tokens(chain.decode(1, [Row(4, 2)])) == reference
    chain.end([2, 3, 4], evict=[1])
    assert chain.status()["prefix_entries"] == 0


def test_a_grammar_constrains_its_row_alone(
    chain: Chain, baseline: list[int], demo_model_factory: Callable[..., Path]
) -> None:
    """Sequence 1 must write a JSON object; sequence 2, in the same micro-batch, is free."""
    tokenizer = load_tokenizer(demo_model_factory(layers=5))
    chain.begin(1, grammar=JSON_OBJECT)
    chain.begin(2)
    constrained = []
    for position in (0, 1, 2):
        first, second = chain.tokens(chain.decode(0, [Row(1, position), Row(2, position)]))
        constrained.append(first)
        if position < 2:
            assert second == baseline[position]
    assert not tokenizer.decode(baseline).startswith("{")  # free, it writes something else
    assert tokenizer.decode(constrained).startswith("{")
    chain.end([1, 2])


def test_a_grammar_that_does_not_compile_refuses_its_row_alone(
    stage: LiveStage, chain: Chain, baseline: list[int]
) -> None:
    """The refusal travels in the row's score; the other row and the session go on."""
    since = stage.log_size()
    chain.begin(1, grammar=UNKNOWN_TOKEN)
    chain.begin(2)
    answer = chain.answer(chain.decode(0, [Row(1, 0), Row(2, 0)]))
    refusal, score = answer.scores()
    assert isinstance(refusal, str) and "the output grammar is invalid" in refusal
    assert score is None and answer.tokens()[1] == baseline[0]
    stage.wait_for_log("sequence 1 \\(tamper\\) refused", since)
    chain.end([1])
    assert chain.tokens(chain.decode(0, [Row(2, 1)])) == baseline[1:]
    chain.end([2])
