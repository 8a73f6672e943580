"""The pipeline's frame codec, socket-free: round trips, stage times, bindings, and the
refusals of what does not decode or answer what was asked."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engines.core.request import GenerationRequest
from engines.pipeline import sequence_documents, wire
from engines.pipeline.admission import sampling_of
from engines.pipeline.sequence_documents import (
    MAX_EVICT_PER_END,
    PENALTY_CONTEXT,
    DiskRollCall,
    EndOrders,
    begin_request,
    disk_roll_call_of,
    end_frame,
    load_orders_of,
    prefix_entry_of,
)
from engines.pipeline.wire import PREFILL_GROUP, Frame, Kind, Row, WireError
from errors import ChannelError
from tests.helpers.live_stage import JSON_OBJECT, LAST, SESSION

pytestmark = pytest.mark.cluster


def test_frames_carry_stage_times_and_only_answers_and_activations_may() -> None:
    hidden = mx.zeros((1, 1, 4), dtype=mx.float32)
    frame = wire.hidden_frame(3, 0, 1, [Row(7, 2)], hidden, [(10, 2), (2**40, 5)])
    decoded = wire.decode(wire.encode(frame))
    assert decoded.times == ((10, 2), (2**40, 5)) and decoded.body == frame.body
    assert wire.decode(wire.encode(wire.token_frame(3, 0, 1, [Row(7, 3)], [5]))).times == ()
    plain = wire.encode(sequence_documents.end_frame(4, [7]))
    flagged = plain[:2] + bytes([wire.STAGE_TIMES]) + plain[3:]
    with pytest.raises(wire.WireError, match="carries stage times"):
        wire.decode(flagged)
    cut = wire.encode(frame)[: wire.HEADER.size + 3 * 4 + wire.ROW.size + 5]
    with pytest.raises(wire.WireError, match="inside its stage times"):
        wire.decode(cut)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_activation_round_trip(dtype: mx.Dtype) -> None:
    hidden = (mx.arange(3 * 5, dtype=mx.float32).reshape(3, 1, 5) / 7).astype(dtype)
    rows = [Row(7, 0), Row(2**40, 12), Row(3, 2**31)]
    frame = wire.decode(wire.encode(wire.hidden_frame(3, 1, 9, rows, hidden)))
    assert (frame.kind, frame.number, frame.group, frame.step) == (Kind.HIDDEN, 3, 1, 9)
    assert frame.rows == tuple(rows)
    restored = frame.tensor()
    assert restored.dtype == dtype and restored.shape == hidden.shape
    assert mx.array_equal(restored, hidden).item()


def test_end_orders_round_trip_and_refusals() -> None:
    frame = wire.decode(wire.encode(end_frame(4, [1, 2], keep=[(2, 30)], evict=[7])))
    assert frame.uids == [1, 2]
    assert EndOrders.of(frame) == EndOrders(((2, 30),), (7,))
    evict_only = wire.decode(wire.encode(end_frame(5, [], evict=[3])))
    assert evict_only.rows == () and EndOrders.of(evict_only).evict == (3,)
    spilling = wire.decode(wire.encode(end_frame(5, [], evict=[3], spill=[4, 5])))
    assert EndOrders.of(spilling) == EndOrders((), (3,), (4, 5))
    for orders in ({"evict": range(MAX_EVICT_PER_END + 1)}, {"spill": range(1001)}):
        with pytest.raises(WireError, match="at most"):
            EndOrders.of(end_frame(6, [], **orders))
    assert load_orders_of({"load": [2, 2**64 - 1]}) == (2, 2**64 - 1)
    for bad in ([-1], [True], "3", list(range(MAX_EVICT_PER_END + 1))):
        with pytest.raises(WireError, match="STATUS load"):
            load_orders_of({"load": bad})
    for keep in ([(1, 0)], [(1, 2), (1, 3)]):  # an empty entry, a sequence kept twice
        with pytest.raises(WireError):
            EndOrders.of(end_frame(7, [1], keep=keep))
    assert prefix_entry_of({"prefix_entry": 2**64 - 1}) == 2**64 - 1
    for bad in (-1, 2**64, True, 1.5, "3"):
        with pytest.raises(WireError, match="not an entry id"):
            prefix_entry_of({"prefix_entry": bad})


def test_share_orders_name_running_sequences_and_fresh_entries() -> None:
    sharing = wire.decode(wire.encode(end_frame(8, [1], evict=[4], share=[(2, 2**63, 70)])))
    assert EndOrders.of(sharing) == EndOrders((), (4,), (), ((2, 2**63, 70),))
    for share in (
        [(1, 9, 5)],  # the frame ends that sequence: it is no longer running
        [(2, 9, 0)],  # an empty prompt
        [(2, 9, 5), (3, 9, 5)],  # two prompts, one entry
    ):
        with pytest.raises(WireError, match="share"):
            EndOrders.of(end_frame(9, [1], share=share))


def test_disk_roll_calls_name_files_by_hex_keys_only() -> None:
    order = DiskRollCall("00ff", ((7, "ab" * 12), (2**64 - 1, "c")), complete=False)
    assert disk_roll_call_of({"disk": order.document()}) == order
    assert disk_roll_call_of({"reports": []}) is None
    bad_orders = (
        {"session": "../x", "adopt": [], "complete": True},
        {"session": "ab", "adopt": [[1, "../../etc/passwd"]], "complete": True},
        {"session": "ab", "adopt": [[-1, "ab"]], "complete": True},
        {"session": "ab", "adopt": [], "complete": 1},
        {"session": "ab", "adopt": [[n, "ab"] for n in range(MAX_EVICT_PER_END + 1)],
         "complete": True},
        [],
    )  # fmt: skip
    for bad in bad_orders:
        with pytest.raises(WireError, match="STATUS disk"):
            disk_roll_call_of({"disk": bad})


def test_grammars_and_refusals_round_trip_and_malformed_ones_are_refused() -> None:
    request = GenerationRequest("x", tuple(range(30)), 8, 0.5, 0.9, grammar=JSON_OBJECT)
    sampling = sampling_of(request)  # the prompt's tail, a seed of its own
    assert sampling.prompt_tokens == tuple(range(30 - PENALTY_CONTEXT, 30))
    assert sampling.seed is not None and sampling.grammar == JSON_OBJECT
    document = sampling.document()
    assert begin_request({**document, "prefix_entry": 3}) == sampling
    for bad in (None, "", 5, True, ["x"], {"x": 1}):
        if bad is None:
            assert begin_request({**document, "grammar": None}).grammar is None
            continue
        with pytest.raises(WireError, match="BEGIN document: grammar must be"):
            begin_request({**document, "grammar": bad})
    for field, bad, reason in (
        ("seed", None, "its seed is not set"),
        ("seed", 2**64 - 1, "seed must be"),
        ("temperature", 2.5, "temperature must be"),
        ("top_p", 0, "top_p must be"),
        ("presence_penalty", float("nan"), "presence_penalty must be"),
        ("repetition_penalty", 0, "repetition_penalty must be"),
        ("logprobs", 21, "logprobs must be"),
        ("prompt_tokens", list(range(PENALTY_CONTEXT + 1)), "more than the penalties'"),
        ("prompt_tokens", [-1], "prompt_tokens must be"),
        ("id", "x", "id must be absent"),
    ):
        with pytest.raises(WireError, match=reason):
            begin_request({**document, field: bad})
    rows = [Row(1, 4), Row(2, 9), Row(3, 0)]
    frame = wire.token_frame(5, 0, 1, rows, [11, 12, 13], scores=[None, "refused", (-0.5, ())])
    assert wire.decode(wire.encode(frame)).scores() == [None, "refused", (-0.5, ())]
    for refusal in ("", "x" * (wire.MAX_REFUSAL_CHARS + 1)):
        frame = wire.token_frame(5, 0, 1, rows[:1], [11], scores=[refusal])
        with pytest.raises(WireError, match="malformed scores"):
            wire.decode(wire.encode(frame))


def test_associated_data_differs_in_every_field() -> None:
    base = (5, range(4, 8), b"")
    variants = [
        (6, range(4, 8), b""),
        (5, range(3, 8), b""),
        (5, range(4, 9), b""),
        (5, range(4, 8), b"x"),
    ]
    assert len({wire.associated_data(*args) for args in [base, *variants]}) == 5


def test_answer_binding_differs_in_every_field() -> None:
    rows = (Row(1, 4), Row(2, 9))
    base = (Kind.TOKEN, 0, 3, rows)
    variants = [
        (Kind.READY, 0, 3, rows),
        (Kind.TOKEN, 1, 3, rows),  # another micro-batch
        (Kind.TOKEN, 0, 4, rows),  # another step
        (Kind.TOKEN, 0, 3, (Row(1, 4), Row(3, 9))),  # a flipped uid
        (Kind.TOKEN, 0, 3, (Row(1, 4), Row(2, 8))),  # another position
        (Kind.TOKEN, 0, 3, rows[::-1]),  # rows swapped
        (Kind.TOKEN, 0, 3, rows[:1]),  # a row dropped
    ]
    assert len({wire.answer_binding(*args) for args in [base, *variants]}) == 8
    frame = wire.token_frame(9, 0, 3, rows, [11, 12])
    assert wire.binding_of(frame) == wire.answer_binding(*base)
    assert wire.binding_of(wire.hidden_frame(9, 0, 3, rows, mx.zeros((2, 1, 4)))) == b""


@pytest.mark.parametrize(
    "sent",
    [
        wire.token_frame(5, 1, 3, [Row(1, 4), Row(2, 9)], [11, 12]),  # another micro-batch
        wire.token_frame(5, 0, 2, [Row(1, 4), Row(2, 9)], [11, 12]),  # a replayed step
        wire.token_frame(5, 0, 3, [Row(1, 4), Row(3, 9)], [11, 12]),  # a flipped uid
        wire.token_frame(4, 0, 3, [Row(1, 4), Row(2, 9)], [11, 12]),  # another frame's answer
        wire.token_frame(5, 0, 3, [Row(1, 4)], [11]),  # a row dropped
    ],
    ids=["micro-batch", "step", "uid", "number", "row"],
)
def test_answer_the_coordinator_does_not_wait_for_does_not_open(sent: Frame) -> None:
    expected = Frame(Kind.TOKEN, 5, 0, 3, (Row(1, 4), Row(2, 9)))
    sealer, opener = SESSION.sealer("client"), SESSION.opener("server")
    sealed = sealer.seal(
        wire.encode(sent), wire.associated_data(sent.number, LAST, wire.binding_of(sent))
    )
    ad = wire.associated_data(expected.number, LAST, wire.binding_of(expected))
    with pytest.raises(ChannelError):
        opener.open(sealed, ad)


class Replay:
    """A channel that opens to one frame, whatever the binding: receive_answer's own checks."""

    def __init__(self, frame: Frame) -> None:
        self.payload = wire.encode(frame)

    def recv(self, timeout_s: float, associated: bytes = b"") -> bytes:
        return self.payload


def test_a_last_chunk_is_answered_with_its_first_token_and_nothing_else() -> None:
    row, last = (Row(1, 30),), wire.LAST_CHUNK
    asked = Frame(Kind.TOKEN, 5, PREFILL_GROUP, 2, row, last)
    answer = wire.token_frame(5, PREFILL_GROUP, 2, row, [7], flags=last)
    assert wire.receive_answer(Replay(answer), 1.0, asked, LAST).tokens() == [7]
    acknowledgement = wire.token_frame(5, PREFILL_GROUP, 2, row, [])
    with pytest.raises(WireError, match="binding says"):  # it did not sample
        wire.receive_answer(Replay(acknowledgement), 1.0, asked, LAST)
    with pytest.raises(WireError, match="binding says"):  # it sampled, unasked
        wire.receive_answer(Replay(answer), 1.0, Frame(Kind.TOKEN, 5, PREFILL_GROUP, 2, row), LAST)
    for tokens in ([], [7, 8]):  # a last chunk's answer carries exactly one token per row
        with pytest.raises(WireError, match="carries"):
            wire.decode(wire.encode(wire.token_frame(5, PREFILL_GROUP, 2, row, tokens, flags=last)))


def test_a_verifying_pass_is_one_row_of_several_positions_answered_per_position() -> None:
    row, verify = (Row(1, 30),), wire.VERIFY
    hidden = mx.zeros((1, 3, 4), dtype=mx.float32)
    frame = wire.decode(wire.encode(wire.hidden_frame(5, 0, 2, row, hidden, flags=verify)))
    assert frame.verifies and frame.tensor().shape == (1, 3, 4)
    asked = Frame(Kind.TOKEN, 5, 0, 2, row, verify)
    answer = wire.token_frame(5, 0, 2, row, [7, 8, 9], flags=verify)
    assert wire.receive_answer(Replay(answer), 1.0, asked, LAST).tokens() == [7, 8, 9]
    with pytest.raises(WireError, match="binding says"):  # a plain step's answer
        wire.receive_answer(Replay(wire.token_frame(5, 0, 2, row, [7])), 1.0, asked, LAST)
    refused = [
        wire.hidden_frame(5, 0, 2, row, hidden),  # several positions, unflagged
        wire.hidden_frame(5, 0, 2, row, hidden[:, :1], flags=verify),  # one position
        wire.hidden_frame(5, 0, 2, (*row, Row(2, 4)), mx.zeros((2, 3, 4)), flags=verify),
        wire.hidden_frame(5, PREFILL_GROUP, 2, row, hidden, flags=verify),
        wire.token_frame(5, 0, 2, row, [7], flags=verify),  # one token
    ]
    for sent in refused:
        with pytest.raises(WireError):
            wire.decode(wire.encode(sent))
