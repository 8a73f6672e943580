"""The coordinator's micro-batch schedule, socket-free: prefill chunks and decode frames."""

from __future__ import annotations

import pytest

from engines.pipeline.schedule import MicroBatchSchedule, Planned
from engines.pipeline.wire import PREFILL_GROUP, Row

pytestmark = pytest.mark.cluster

# -- the coordinator's schedule, socket-free -----------------------------------------------------


def describe(frames: list[Planned]) -> list[tuple]:
    return [(frame.group, frame.step, frame.rows, frame.tokens, frame.begins) for frame in frames]


def test_schedule_plans_prefill_and_decode_frames() -> None:
    schedule = MicroBatchSchedule(groups=2, prefill_chunk=2, prefill_in_flight=2)
    schedule.add(2, [20])  # one token: its only chunk is its last, which samples
    schedule.add(1, [10, 11, 12, 13])  # chunks [10, 11] and [12, 13], the last sampling
    frames = schedule.plan()  # nobody decodes: two chunks fill the pipe
    assert describe(frames) == [
        (PREFILL_GROUP, 1, (Row(2, 0),), (20,), (2,)),
        (PREFILL_GROUP, 2, (Row(1, 0),), (10, 11), (1,)),
    ]
    assert [frame.last_chunk for frame in frames] == [True, False]
    assert schedule.answered([7]) == [(2, 7)]  # 2's first token: it joins micro-batch 0
    assert describe(schedule.plan()) == [(0, 1, (Row(2, 1),), (7,), ())]  # one chunk is out
    assert schedule.answered([]) == []  # the chunk's acknowledgement
    frames = schedule.plan()  # one chunk at a time while 2 decodes
    assert describe(frames) == [(PREFILL_GROUP, 3, (Row(1, 2),), (12, 13), ())]
    assert frames[0].last_chunk
    assert schedule.answered([8]) == [(2, 8)]
    assert schedule.answered([5]) == [(1, 5)]  # 1's first token: it joins the idle batch 1
    assert describe(schedule.plan()) == [
        (0, 2, (Row(2, 2),), (8,), ()),
        (1, 1, (Row(1, 4),), (5,), ()),
    ]
    assert schedule.sizes() == [1, 1] and schedule.in_flight == 2
    assert schedule.remove([2, 99]) == [2]  # the stages know 2; 99 never existed
    assert schedule.answered([9]) == []  # 2's token was on its way: dropped
    assert schedule.answered([6]) == [(1, 6)]
    assert describe(schedule.plan()) == [(1, 2, (Row(1, 5),), (6,), ())]


def test_schedule_prefills_newcomers_in_turn_and_fills_the_pipe_when_idle() -> None:
    schedule = MicroBatchSchedule(groups=3, prefill_chunk=1, prefill_in_flight=3)
    schedule.add(1, [10, 11, 12, 13])
    schedule.add(2, [20, 21])
    frames = schedule.plan()  # nobody decodes: three chunks, newcomers taking turns
    assert [(frame.rows, frame.tokens, frame.last_chunk) for frame in frames] == [
        ((Row(1, 0),), (10,), False),
        ((Row(2, 0),), (20,), False),
        ((Row(1, 1),), (11,), False),
    ]
    assert schedule.answered([]) == [] and schedule.answered([]) == []
    frames = schedule.plan()  # 2's prompt ends: its last chunk samples
    assert [(frame.rows, frame.tokens, frame.last_chunk) for frame in frames] == [
        ((Row(2, 1),), (21,), True),
        ((Row(1, 2),), (12,), False),
    ]


def test_short_prompts_arriving_while_others_decode_go_down_together() -> None:
    schedule = MicroBatchSchedule(groups=2, prefill_chunk=4, prefill_in_flight=3)
    schedule.add(1, [10])
    schedule.plan()
    assert schedule.answered([7]) == [(1, 7)]  # 1 decodes from here on
    schedule.add(2, [20, 21])
    schedule.add(3, [30, 31])
    schedule.add(4, [40, 41, 42, 43, 44, 45])
    frames = schedule.plan()  # a chunk's worth (4 tokens): 2 and 3 at once, 4 waits
    assert [(frame.group, frame.rows, frame.tokens) for frame in frames] == [
        (0, (Row(1, 1),), (7,)),
        (PREFILL_GROUP, (Row(2, 0),), (20, 21)),
        (PREFILL_GROUP, (Row(3, 0),), (30, 31)),
    ]
    assert schedule.plan() == []  # the budget is out until those chunks are answered
    assert schedule.answered([8]) == [(1, 8)]
    assert schedule.answered([5]) == [(2, 5)]
    frames = schedule.plan()  # 3's 2 tokens are still out: 4's first chunk (4) must wait
    assert [frame.group for frame in frames] == [0, 1]  # 1 and newcomer 2 decode
    assert schedule.answered([6]) == [(3, 6)]
    frames = schedule.plan()  # a long prompt still goes a chunk at a time
    assert [(frame.rows, frame.tokens) for frame in frames] == [
        ((Row(4, 0),), (40, 41, 42, 43)),
    ]


def test_schedule_restarts_only_without_known_sequences() -> None:
    schedule = MicroBatchSchedule(groups=2, prefill_chunk=4, prefill_in_flight=2)
    schedule.add(1, [1, 2])
    schedule.plan()
    with pytest.raises(ValueError, match="cannot restart"):
        schedule.restart()
    schedule.clear()
    schedule.add(1, [1, 2])
    assert describe(schedule.plan())[0] == (PREFILL_GROUP, 1, (Row(1, 0),), (1, 2), (1,))


def test_with_quantized_kv_a_prompt_sends_its_last_token_alone_once_the_rest_reaches_start():
    """As mlx-lm's generate_step: a prompt but its last token, the cache quantized when that
    reaches quantized_kv_start, then the last token over the quantized cache."""
    schedule = MicroBatchSchedule(
        groups=1, prefill_chunk=4, prefill_in_flight=8, quantized_kv_start=3
    )
    schedule.add(1, [10, 11, 12, 13, 14, 15])  # 5 tokens reach 3: [10..13], [14], then [15]
    schedule.add(2, [20, 21, 22])  # 2 tokens do not: one chunk, as without quantization
    schedule.add(3, [30])  # nothing before its last token
    frames = schedule.plan()  # nobody decodes: every chunk goes down at once, in order
    assert [(frame.rows[0], frame.tokens, frame.last_chunk) for frame in frames] == [
        (Row(1, 0), (10, 11, 12, 13), False),
        (Row(2, 0), (20, 21, 22), True),
        (Row(3, 0), (30,), True),
        (Row(1, 4), (14,), False),
        (Row(1, 5), (15,), True),
    ]
