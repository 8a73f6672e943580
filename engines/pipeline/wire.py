"""The pipeline wire: frame header, rows, tensor bytes, and the associated data that binds frames.

A frame's plaintext (sealed whole by the hop's SecureChannel) is

    version u8 | kind u8 | flags u8 | dtype u8 | ndim u8 | number u64 | group u16 | step u32 |
    rows u16 | shape (ndim x u32) | rows x (uid u64, position u32) | [times] | body

all big-endian. `number` counts the frames the coordinator sends down a session (SETUP is 0);
an answer (TOKEN, READY) carries the number of the frame it answers. `group` is the micro-batch
(PREFILL_GROUP for a prefill chunk) and `step` that micro-batch's frame count. Each row is a
sequence (uid) and how many of its tokens the KV caches held before this frame (position).
HIDDEN bodies are the raw row-major bytes of a (B, L, D) activation, one row per sequence
(L = 1 for a decode frame, but for one flagged VERIFY: one row, its next token and the tokens
drafted after it, which the last stage samples at every position; the next frame's position
of that row says how many were kept, and every stage trims the rest); TOKEN bodies one u32
per row (empty for a prefill chunk's acknowledgement, one for a prefill chunk flagged
LAST_CHUNK: it ends its prompt, and the last stage samples the sequence's first token from
it; one per position for a decode frame flagged VERIFY), then, when flagged SCORES, a JSON
list with each row's [logprob, [[id, logprob], ...]] or null, or a string when the last
stage refused that row's sequence (its grammar did not compile there: the row's token
means nothing); BEGIN / SETUP / STATUS / READY / END bodies UTF-8 JSON objects. A BEGIN
row's position is where the sequence starts: 0, or the tokens it takes from the prefix-cache
entry its document names; its document may carry an output grammar the last stage applies. An
END may keep ended sequences' caches (or a running sequence's prompt) as prefix-cache entries
and drop entries (then it may have no rows). A HIDDEN or TOKEN frame with the STAGE_TIMES flag
carries, before its body, `count u8` and count x (compute µs u64, sealing µs u64): each remote
stage it passed appends its session's running totals (engines/pipeline/frame_clock.py).
docs/pipeline.md describes the flow.
"""

from __future__ import annotations

import enum
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from engines.core.request import MAX_TOP_LOGPROBS
from errors import ChannelError

# 5: BEGIN carries an output grammar (a v4 last stage would ignore it and sample freely)
# 6: BEGIN carries the request's document (a v5 last stage would ignore its penalties)
# 7: a prompt's last chunk (LAST_CHUNK) samples its first token; END may spill entries to disk
# 8: END may keep a running sequence's prompt as an entry (`share`); STATUS may adopt files
# 9: a VERIFY decode frame carries a lone sequence's next token and draft; its answer a token
#    per position; a row's position may go back (rejected draft positions are trimmed)
VERSION = 9
PURPOSE = b"pipeline"  # the SecureChannel purpose of every pipeline hop
AD_LABEL = b"tandem pipeline v9"
HEADER = struct.Struct(">BBBBBQHIH")
DIM = struct.Struct(">I")
ROW = struct.Struct(">QI")
AD_FIELDS = struct.Struct(">QII")
BINDING = struct.Struct(">BHIH")
TOKEN = struct.Struct(">I")
MAX_NDIM = 4
MAX_ROWS = 1024
MAX_JSON_BYTES = 64 * 1024
# 64 MiB of activation per frame: a 256-token chunk of a 16384-wide float32 model fits.
MAX_FRAME_BYTES = 64 * 1024 * 1024
STAGE_TIMES = 0x01  # flag: the frame carries the stages' running times (see above)
SCORES = 0x02  # flag: a TOKEN frame that carries log-probabilities after its tokens
LAST_CHUNK = 0x04  # flag: a prefill chunk ending its prompt, and its answer's first token
VERIFY = 0x08  # flag: a one-row decode frame of several positions, and its token per position
KNOWN_FLAGS = STAGE_TIMES | SCORES | LAST_CHUNK | VERIFY
MAX_VERIFIED = 64  # positions of a VERIFY frame: the next token and at most 63 drafted
TIMES_COUNT = struct.Struct(">B")
STAGE_TIME = struct.Struct(">QQ")
MAX_TIMED_STAGES = 255
PREFILL_GROUP = 0xFFFF  # the group of prefill chunks; decode micro-batches are 0, 1, ...
# SETUP is the first frame of a session: nobody knows the sender's range yet.
SETUP_SENDER = range(0, 0)
MAX_REFUSAL_CHARS = 512  # a TOKEN row's refusal message


class WireError(ChannelError):
    """A frame opened but its content is malformed or not the one expected next."""


class Kind(enum.IntEnum):
    SETUP = 1  # coordinator -> ... -> last: roll call of the stages' layer ranges
    READY = 2  # last -> coordinator: the completed roll call
    BEGIN = 3  # a sequence joins: its sampling parameters and seed
    HIDDEN = 4  # activations of a micro-batch (decode) or of one prefill chunk
    TOKEN = 5  # last -> coordinator: the sampled tokens (or a prefill chunk's acknowledgement)
    END = 6  # sequences are over: free (or keep as prefix-cache entries) their KV; drop entries
    STATUS = 7  # roll call of the stages' counters (answered with READY)


ANSWERS = (Kind.TOKEN, Kind.READY)  # what comes back to the coordinator
ROW_KINDS = (Kind.BEGIN, Kind.HIDDEN, Kind.TOKEN, Kind.END)
DOCUMENT_KINDS = (Kind.BEGIN, Kind.SETUP, Kind.STATUS, Kind.READY, Kind.END)

# wire code -> (mlx dtype, numpy carrier of the same width: bfloat16 travels as uint16)
DTYPES: dict[int, tuple[mx.Dtype, type[np.generic]]] = {
    1: (mx.float32, np.float32),
    2: (mx.float16, np.float16),
    3: (mx.bfloat16, np.uint16),
}
DTYPE_CODES = {dtype: code for code, (dtype, _) in DTYPES.items()}

# a TOKEN row's score: None, (logprob, ((id, logprob), ...)), or why its sequence was refused
Score = tuple[float, tuple[tuple[int, float], ...]] | str | None


class Channel(Protocol):
    """What a hop needs from discovery.secure_channel.SecureChannel."""

    def send(self, payload: bytes, associated: bytes = b"") -> None: ...

    def recv(self, timeout_s: float, associated: bytes = b"") -> bytes: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Row:
    """One sequence in a frame: its uid and the tokens its KV caches held before the frame."""

    uid: int
    position: int


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded pipeline frame."""

    kind: Kind
    number: int
    group: int = 0
    step: int = 0
    rows: tuple[Row, ...] = ()
    flags: int = 0
    dtype: int = 0
    shape: tuple[int, ...] = ()
    body: bytes = b""
    times: tuple[tuple[int, int], ...] = ()  # per remote stage: (compute µs, sealing µs) so far

    @property
    def is_prefill(self) -> bool:
        return self.group == PREFILL_GROUP

    @property
    def uids(self) -> list[int]:
        return [row.uid for row in self.rows]

    def tensor(self) -> mx.array:
        """The activation of a HIDDEN frame as an mlx array of its wire dtype and shape."""
        dtype, carrier = DTYPES[self.dtype]
        values = np.frombuffer(self.body, dtype=carrier).reshape(self.shape)
        array = mx.array(values)
        return array.view(dtype) if array.dtype != dtype else array

    @property
    def samples(self) -> bool:
        """Whether the last stage samples a token per row: a decode step, or a prompt's last
        prefill chunk."""
        return not self.is_prefill or bool(self.flags & LAST_CHUNK)

    @property
    def verifies(self) -> bool:
        return bool(self.flags & VERIFY)

    def tokens(self) -> list[int]:
        """A TOKEN frame's sampled tokens, one per row (none for a prefill acknowledgement,
        one per position of a VERIFY frame's row)."""
        width = TOKEN.size * (len(self.rows) if self.samples else 0)
        if self.verifies:
            width = len(self.body)
        return [value for (value,) in TOKEN.iter_unpack(self.body[:width])]

    def scores(self) -> list[Score]:
        """A SCORES TOKEN frame's (logprob, top alternatives) per row; None for rows without,
        a refusal message for a row whose sequence the last stage refused."""
        if not self.flags & SCORES:
            return [None] * len(self.rows)
        width = TOKEN.size * len(self.rows)
        try:
            entries = json.loads(self.body[width:].decode("utf-8"))
            if not isinstance(entries, list) or len(entries) != len(self.rows):
                raise ValueError("not one entry per row")
            return [_score(entry) for entry in entries]
        except (UnicodeDecodeError, ValueError, TypeError, RecursionError) as error:
            raise WireError(f"malformed scores in a TOKEN frame: {error}") from None

    def document(self) -> dict[str, Any]:
        """The JSON object a BEGIN / SETUP / STATUS / READY frame carries."""
        try:
            value = json.loads(self.body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as error:
            raise WireError(f"{self.kind.name} frame body is not UTF-8 JSON: {error}") from None
        if not isinstance(value, dict):
            raise WireError(f"{self.kind.name} frame body is JSON but not an object")
        return value

    def describe(self) -> str:
        return (
            f"{self.kind.name} #{self.number} group {self.group} step {self.step} "
            f"rows {[(row.uid, row.position) for row in self.rows]}"
        )


def associated_data(number: int, sender: range, binding: bytes = b"") -> bytes:
    """What a frame binds besides the channel's own fields: its number, the sender's layers,
    and (answers only) `binding`, the rest of the header the receiver is waiting for."""
    return AD_LABEL + AD_FIELDS.pack(number, sender.start, sender.stop) + binding


def answer_binding(kind: Kind, group: int, step: int, rows: Sequence[Row]) -> bytes:
    """An answer's kind, micro-batch, step, uids and positions: the coordinator knows them all."""
    packed = b"".join(ROW.pack(row.uid, row.position) for row in rows)
    return BINDING.pack(kind, group, step, len(rows)) + packed


def binding_of(frame: Frame) -> bytes:
    """The AD binding a frame is sealed with: its whole header for answers, nothing else."""
    if frame.kind in ANSWERS:
        return answer_binding(frame.kind, frame.group, frame.step, frame.rows)
    return b""


def hidden_frame(
    number: int,
    group: int,
    step: int,
    rows: Sequence[Row],
    hidden: mx.array,
    times: Sequence[tuple[int, int]] = (),
    flags: int = 0,
) -> Frame:
    """A HIDDEN frame from an evaluated (B, L, D) activation, one row per sequence; `flags`
    LAST_CHUNK marks a prefill chunk that ends its prompt, VERIFY a lone sequence's draft."""
    code = DTYPE_CODES.get(hidden.dtype)
    if code is None:
        raise WireError(f"activations of dtype {hidden.dtype} cannot travel on the pipeline wire")
    body = memoryview(hidden).tobytes()  # row-major, whatever the array's strides
    shape = tuple(hidden.shape)
    rows = tuple(rows)
    return Frame(Kind.HIDDEN, number, group, step, rows, flags, code, shape, body, tuple(times))


def token_frame(
    number: int,
    group: int,
    step: int,
    rows: Sequence[Row],
    tokens: Sequence[int],
    times: Sequence[tuple[int, int]] = (),
    scores: Sequence[Any] | None = None,
    flags: int = 0,
) -> Frame:
    """`scores`: per row None, (logprob, [(id, logprob), ...]) or a refusal message; sent only
    when one is set."""
    body = b"".join(TOKEN.pack(token) for token in tokens)
    if scores is not None and any(score is not None for score in scores):
        flags |= SCORES
        entries = [
            s if s is None or isinstance(s, str) else [s[0], [list(pair) for pair in s[1]]]
            for s in scores
        ]
        body += json.dumps(entries, separators=(",", ":")).encode("utf-8")
    return Frame(
        Kind.TOKEN, number, group, step, tuple(rows), flags=flags, body=body, times=tuple(times)
    )


def _score(entry: Any) -> Score:
    if entry is None:
        return None
    if isinstance(entry, str):
        if not 0 < len(entry) <= MAX_REFUSAL_CHARS:
            raise ValueError(f"a refusal of {len(entry)} characters")
        return entry
    chosen, top = entry
    if len(top) > MAX_TOP_LOGPROBS:
        raise ValueError(f"{len(top)} alternatives, more than {MAX_TOP_LOGPROBS}")
    return float(chosen), tuple((int(token), float(value)) for token, value in top)


def document_frame(
    kind: Kind, number: int, document: dict[str, Any], rows: Sequence[Row] = ()
) -> Frame:
    body = json.dumps(document, separators=(",", ":")).encode("utf-8")
    if len(body) > MAX_JSON_BYTES:
        raise WireError(f"{kind.name} document of {len(body)} bytes exceeds {MAX_JSON_BYTES}")
    return Frame(kind, number, rows=tuple(rows), body=body)


def encode(frame: Frame) -> bytes:
    """The plaintext of a frame; the channel seals it."""
    flags = frame.flags | STAGE_TIMES if frame.times else frame.flags & ~STAGE_TIMES
    header = HEADER.pack(
        VERSION,
        frame.kind,
        flags,
        frame.dtype,
        len(frame.shape),
        frame.number,
        frame.group,
        frame.step,
        len(frame.rows),
    )
    dims = b"".join(DIM.pack(size) for size in frame.shape)
    rows = b"".join(ROW.pack(row.uid, row.position) for row in frame.rows)
    times = b""
    if frame.times:
        if len(frame.times) > MAX_TIMED_STAGES:
            raise WireError(f"times of {len(frame.times)} stages (at most {MAX_TIMED_STAGES})")
        times = TIMES_COUNT.pack(len(frame.times))
        times += b"".join(STAGE_TIME.pack(*entry) for entry in frame.times)
    return header + dims + rows + times + frame.body


def decode(payload: bytes) -> Frame:
    """Parse and validate a frame's plaintext; anything malformed raises WireError."""
    if len(payload) < HEADER.size:
        raise WireError(
            f"frame of {len(payload)} bytes is shorter than the {HEADER.size}-byte header"
        )
    version, kind, flags, dtype, ndim, number, group, step, count = HEADER.unpack_from(payload)
    if version != VERSION:
        raise WireError(f"pipeline wire version {version}; this node speaks {VERSION}")
    try:
        kind = Kind(kind)
    except ValueError:
        raise WireError(f"unknown frame kind {kind}") from None
    if flags & ~KNOWN_FLAGS:
        raise WireError(f"unknown flags {flags:#x} on a {kind.name} frame")
    if ndim > MAX_NDIM:
        raise WireError(f"{kind.name} frame claims {ndim} dimensions (at most {MAX_NDIM})")
    if count > MAX_ROWS:
        raise WireError(f"{kind.name} frame claims {count} rows (at most {MAX_ROWS})")
    offset = HEADER.size + ndim * DIM.size + count * ROW.size
    if len(payload) < offset:
        raise WireError(f"{kind.name} frame ends inside its shape or rows")
    shape = tuple(
        DIM.unpack_from(payload, HEADER.size + index * DIM.size)[0] for index in range(ndim)
    )
    start = HEADER.size + ndim * DIM.size
    rows = tuple(Row(*ROW.unpack_from(payload, start + index * ROW.size)) for index in range(count))
    times: tuple[tuple[int, int], ...] = ()
    if flags & STAGE_TIMES:
        if kind not in (Kind.HIDDEN, Kind.TOKEN):
            raise WireError(f"{kind.name} frame carries stage times")
        times, offset = _decode_times(payload, offset, kind)
    body = payload[offset:]
    frame = Frame(kind, number, group, step, rows, flags, dtype, shape, bytes(body), times)
    _validate(frame)
    return frame


def _decode_times(payload: bytes, offset: int, kind: Kind) -> tuple[tuple, int]:
    """The stage times section at `offset`, and the offset after it."""
    if len(payload) < offset + TIMES_COUNT.size:
        raise WireError(f"{kind.name} frame ends inside its stage times")
    (count,) = TIMES_COUNT.unpack_from(payload, offset)
    offset += TIMES_COUNT.size
    if not count or len(payload) < offset + count * STAGE_TIME.size:
        raise WireError(f"{kind.name} frame ends inside its stage times")
    times = tuple(
        STAGE_TIME.unpack_from(payload, offset + index * STAGE_TIME.size) for index in range(count)
    )
    return times, offset + count * STAGE_TIME.size


def _validate(frame: Frame) -> None:
    kind = frame.kind
    if kind in ROW_KINDS and not frame.rows and kind is not Kind.END:  # END may only evict
        raise WireError(f"{kind.name} frame has no rows")
    if frame.flags & SCORES and kind is not Kind.TOKEN:
        raise WireError(f"{kind.name} frame carries scores (flags {frame.flags:#x})")
    if frame.flags & LAST_CHUNK and not (kind in (Kind.HIDDEN, Kind.TOKEN) and frame.is_prefill):
        raise WireError(f"{kind.name} frame of group {frame.group} flags a prompt's last chunk")
    if frame.verifies and (kind not in (Kind.HIDDEN, Kind.TOKEN) or frame.is_prefill):
        raise WireError(f"{kind.name} frame of group {frame.group} flags a verifying pass")
    if frame.verifies and (len(frame.rows) != 1 or frame.flags & SCORES):
        raise WireError(f"a verifying {kind.name} frame has {len(frame.rows)} rows, not 1")
    if kind not in ROW_KINDS and frame.rows:
        raise WireError(f"{kind.name} frame carries {len(frame.rows)} rows")
    if kind is Kind.BEGIN and len(frame.rows) != 1:
        raise WireError(f"BEGIN frame has {len(frame.rows)} rows, not 1")
    if len({row.uid for row in frame.rows}) != len(frame.rows):
        raise WireError(f"{kind.name} frame lists a uid twice: {frame.uids}")
    if kind not in (Kind.HIDDEN, Kind.TOKEN) and (frame.group or frame.step):
        raise WireError(f"{kind.name} frame carries a group or step")
    if kind is Kind.HIDDEN:
        _validate_hidden(frame)
        return
    if frame.dtype or frame.shape:
        raise WireError(f"{kind.name} frame carries a dtype or shape")
    if kind is Kind.TOKEN:
        expected = TOKEN.size * len(frame.rows) if frame.samples else 0
        if frame.verifies:
            _validate_verified(frame)
        elif frame.flags & SCORES and frame.samples:
            if len(frame.body) - expected > MAX_JSON_BYTES:
                raise WireError(f"TOKEN frame scores exceed {MAX_JSON_BYTES} bytes")
            frame.scores()
        elif len(frame.body) != expected:
            raise WireError(
                f"TOKEN frame for {len(frame.rows)} rows of group {frame.group} carries "
                f"{len(frame.body)} bytes, not {expected}"
            )
    if kind in DOCUMENT_KINDS:
        if len(frame.body) > MAX_JSON_BYTES:
            raise WireError(f"{kind.name} body of {len(frame.body)} bytes exceeds {MAX_JSON_BYTES}")
        frame.document()


def _validate_hidden(frame: Frame) -> None:
    if frame.dtype not in DTYPES:
        raise WireError(f"HIDDEN frame has unknown dtype code {frame.dtype}")
    shape = frame.shape
    if len(shape) != 3 or 0 in shape or shape[0] != len(frame.rows):
        raise WireError(
            f"HIDDEN frame shape {shape} is not (B, L, D) with B = {len(frame.rows)} rows"
        )
    if frame.is_prefill and shape[0] != 1:
        raise WireError(f"a prefill chunk carries one sequence, this one {shape[0]}")
    if not frame.is_prefill and shape[1] != 1 and not frame.verifies:
        raise WireError(f"a decode micro-batch carries one token per row, this one {shape[1]}")
    if frame.verifies and not 1 < shape[1] <= MAX_VERIFIED:
        raise WireError(f"a verifying frame carries 2 to {MAX_VERIFIED} positions, not {shape[1]}")
    itemsize = np.dtype(DTYPES[frame.dtype][1]).itemsize
    expected = math.prod(shape) * itemsize
    if len(frame.body) != expected:
        raise WireError(
            f"HIDDEN frame of shape {shape} needs {expected} bytes, carries {len(frame.body)}"
        )


def _validate_verified(frame: Frame) -> None:
    """A VERIFY answer: a token per position of its one row."""
    count, rest = divmod(len(frame.body), TOKEN.size)
    if rest or not 1 < count <= MAX_VERIFIED:
        raise WireError(f"a verifying TOKEN frame carries {len(frame.body)} bytes of tokens")


def send(channel: Channel, frame: Frame, sender: range) -> None:
    """Seal and send `frame`, binding it to its number, `sender`'s layers and (answers) header."""
    channel.send(encode(frame), associated_data(frame.number, sender, binding_of(frame)))


def receive(
    channel: Channel, timeout_s: float, number: int, sender: range, kinds: tuple[Kind, ...]
) -> Frame:
    """Open the next frame down the chain, which must be number `number` from `sender`.

    A stage cannot know which micro-batch comes next, so only the number and the sender are
    bound here; the stage checks the rows against its own caches (engines/pipeline/batches.py).
    Raises ChannelError (framing.ChannelTimeout when nothing arrived in time) or WireError.
    """
    frame = decode(channel.recv(timeout_s, associated_data(number, sender)))
    if frame.number != number:
        raise WireError(
            f"frame header says number {frame.number}, the sealed binding says {number}"
        )
    if frame.kind not in kinds:
        expected = " or ".join(kind.name for kind in kinds)
        raise WireError(f"expected a {expected} frame as #{number}, got {frame.kind.name}")
    return frame


def receive_answer(channel: Channel, timeout_s: float, expected: Frame, sender: range) -> Frame:
    """Open the answer the coordinator waits for: kind, number, micro-batch, step and rows of
    `expected` are all bound, so an answer for another micro-batch or step does not open."""
    binding = binding_of(expected)
    frame = decode(channel.recv(timeout_s, associated_data(expected.number, sender, binding)))
    unasked = (frame.flags ^ expected.flags) & (LAST_CHUNK | VERIFY)  # it samples as asked
    if binding_of(frame) != binding or frame.number != expected.number or unasked:
        raise WireError(
            f"answer header says {frame.describe()}, the sealed binding says {expected.describe()}"
        )
    return frame
