"""The pipeline wire: frame header, tensor bytes, and the associated data that binds each frame.

A frame's plaintext (sealed whole by the hop's SecureChannel) is

    version u8 | kind u8 | flags u8 | dtype u8 | ndim u8 | request u64 | step u32 |
    shape (ndim x u32) | body

all big-endian. HIDDEN bodies are the raw row-major bytes of a (1, L, D) activation; TOKEN
bodies one u32; BEGIN / SETUP / STATUS / READY bodies UTF-8 JSON objects; END bodies empty.
The associated data (see `associated_data`) binds request, the sender's layer range and step,
on top of what the channel binds (cluster id, session id, direction, counter). docs/pipeline.md
describes the flow.
"""

from __future__ import annotations

import enum
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from planner.errors import ChannelError

VERSION = 1
PURPOSE = b"pipeline"  # the SecureChannel purpose of every pipeline hop
AD_LABEL = b"tandem pipeline v1"
HEADER = struct.Struct(">BBBBBQI")
DIM = struct.Struct(">I")
AD_FIELDS = struct.Struct(">QIII")
TOKEN = struct.Struct(">I")
MAX_NDIM = 4
MAX_JSON_BYTES = 64 * 1024
# 64 MiB of activation per frame: a 256-token chunk of a 16384-wide float32 model fits.
MAX_FRAME_BYTES = 64 * 1024 * 1024
FLAG_SAMPLE = 0x01
KNOWN_FLAGS = FLAG_SAMPLE
# SETUP is the first frame of a session: nobody knows the sender's range yet.
SETUP_SENDER = range(0, 0)
MAX_SEED = 2**64 - 1  # mlx seeds are unsigned 64-bit
MAX_TEMPERATURE = 100.0
MAX_LABEL_CHARS = 128


class WireError(ChannelError):
    """A frame opened but its content is malformed or not the one expected next."""


class Kind(enum.IntEnum):
    SETUP = 1  # coordinator -> ... -> last: roll call of the stages' layer ranges
    READY = 2  # last -> coordinator: the completed roll call
    BEGIN = 3  # a request starts: sampling parameters and seed
    HIDDEN = 4  # one forward pass worth of activations (a prefill chunk or a decode step)
    TOKEN = 5  # last -> coordinator: the sampled token
    END = 6  # the request is over: free its KV cache
    STATUS = 7  # roll call of the stages' counters (answered with READY)


# wire code -> (mlx dtype, numpy carrier of the same width: bfloat16 travels as uint16)
DTYPES: dict[int, tuple[mx.Dtype, type[np.generic]]] = {
    1: (mx.float32, np.float32),
    2: (mx.float16, np.float16),
    3: (mx.bfloat16, np.uint16),
}
DTYPE_CODES = {dtype: code for code, (dtype, _) in DTYPES.items()}


class Channel(Protocol):
    """What a hop needs from discovery.secure_channel.SecureChannel."""

    def send(self, payload: bytes, associated: bytes = b"") -> None: ...

    def recv(self, timeout_s: float, associated: bytes = b"") -> bytes: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded pipeline frame."""

    kind: Kind
    request: int
    step: int
    flags: int = 0
    dtype: int = 0
    shape: tuple[int, ...] = ()
    body: bytes = b""

    @property
    def sample(self) -> bool:
        return bool(self.flags & FLAG_SAMPLE)

    def tensor(self) -> mx.array:
        """The activation of a HIDDEN frame as an mlx array of its wire dtype and shape."""
        dtype, carrier = DTYPES[self.dtype]
        values = np.frombuffer(self.body, dtype=carrier).reshape(self.shape)
        array = mx.array(values)
        return array.view(dtype) if array.dtype != dtype else array

    def token(self) -> int:
        return TOKEN.unpack(self.body)[0]

    def document(self) -> dict[str, Any]:
        """The JSON object a BEGIN / SETUP / STATUS / READY frame carries."""
        try:
            value = json.loads(self.body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as error:
            raise WireError(f"{self.kind.name} frame body is not UTF-8 JSON: {error}") from None
        if not isinstance(value, dict):
            raise WireError(f"{self.kind.name} frame body is JSON but not an object")
        return value


def associated_data(request: int, sender: range, step: int) -> bytes:
    """What every frame binds besides the channel's own fields: request, sender layers, step."""
    return AD_LABEL + AD_FIELDS.pack(request, sender.start, sender.stop, step)


def hidden_frame(request: int, step: int, hidden: mx.array, sample: bool) -> Frame:
    """A HIDDEN frame from an evaluated (1, L, D) activation."""
    code = DTYPE_CODES.get(hidden.dtype)
    if code is None:
        raise WireError(f"activations of dtype {hidden.dtype} cannot travel on the pipeline wire")
    body = memoryview(hidden).tobytes()  # row-major, whatever the array's strides
    flags = FLAG_SAMPLE if sample else 0
    return Frame(Kind.HIDDEN, request, step, flags, code, tuple(hidden.shape), body)


def token_frame(request: int, step: int, token: int) -> Frame:
    return Frame(Kind.TOKEN, request, step, body=TOKEN.pack(token))


def document_frame(kind: Kind, request: int, step: int, document: dict[str, Any]) -> Frame:
    body = json.dumps(document, separators=(",", ":")).encode("utf-8")
    if len(body) > MAX_JSON_BYTES:
        raise WireError(f"{kind.name} document of {len(body)} bytes exceeds {MAX_JSON_BYTES}")
    return Frame(kind, request, step, body=body)


def encode(frame: Frame) -> bytes:
    """The plaintext of a frame; the channel seals it."""
    header = HEADER.pack(
        VERSION, frame.kind, frame.flags, frame.dtype, len(frame.shape), frame.request, frame.step
    )
    dims = b"".join(DIM.pack(size) for size in frame.shape)
    return header + dims + frame.body


def decode(payload: bytes) -> Frame:
    """Parse and validate a frame's plaintext; anything malformed raises WireError."""
    if len(payload) < HEADER.size:
        raise WireError(
            f"frame of {len(payload)} bytes is shorter than the {HEADER.size}-byte header"
        )
    version, kind, flags, dtype, ndim, request, step = HEADER.unpack_from(payload)
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
    offset = HEADER.size + ndim * DIM.size
    if len(payload) < offset:
        raise WireError(f"{kind.name} frame ends inside its shape")
    shape = tuple(
        DIM.unpack_from(payload, HEADER.size + index * DIM.size)[0] for index in range(ndim)
    )
    body = payload[offset:]
    frame = Frame(kind, request, step, flags, dtype, shape, bytes(body))
    _validate_body(frame)
    return frame


def _validate_body(frame: Frame) -> None:
    kind = frame.kind
    if kind is Kind.HIDDEN:
        if frame.dtype not in DTYPES:
            raise WireError(f"HIDDEN frame has unknown dtype code {frame.dtype}")
        if len(frame.shape) != 3 or frame.shape[0] != 1 or 0 in frame.shape:
            raise WireError(f"HIDDEN frame shape {frame.shape} is not (1, L, D) with L, D > 0")
        itemsize = np.dtype(DTYPES[frame.dtype][1]).itemsize
        expected = math.prod(frame.shape) * itemsize
        if len(frame.body) != expected:
            raise WireError(
                f"HIDDEN frame of shape {frame.shape} needs {expected} bytes, carries "
                f"{len(frame.body)}"
            )
        return
    if frame.dtype or frame.shape:
        raise WireError(f"{kind.name} frame carries a dtype or shape")
    if frame.flags and kind is not Kind.HIDDEN:
        raise WireError(f"{kind.name} frame carries flags {frame.flags:#x}")
    if kind is Kind.TOKEN and len(frame.body) != TOKEN.size:
        raise WireError(f"TOKEN frame body is {len(frame.body)} bytes, not {TOKEN.size}")
    if kind is Kind.END and frame.body:
        raise WireError(f"END frame carries {len(frame.body)} unexpected bytes")
    if kind in (Kind.BEGIN, Kind.SETUP, Kind.STATUS, Kind.READY):
        if len(frame.body) > MAX_JSON_BYTES:
            raise WireError(f"{kind.name} body of {len(frame.body)} bytes exceeds {MAX_JSON_BYTES}")
        frame.document()


@dataclass(frozen=True, slots=True)
class Sampling:
    """What a BEGIN frame tells the last stage: how to sample, and a label for its logs."""

    temperature: float
    top_p: float
    seed: int
    label: str = ""

    def document(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "id": self.label[:MAX_LABEL_CHARS],
        }

    @classmethod
    def of(cls, document: dict[str, Any]) -> Sampling:
        """Validate a BEGIN document (WireError when a field is missing or out of range)."""
        try:
            temperature = float(document["temperature"])
            top_p = float(document["top_p"])
            seed = document["seed"]
            label = str(document.get("id", ""))[:MAX_LABEL_CHARS]
        except (KeyError, TypeError, ValueError) as error:
            raise WireError(f"malformed BEGIN document: missing or bad {error}") from None
        if not (isinstance(seed, int) and 0 <= seed <= MAX_SEED):
            raise WireError(f"BEGIN seed {seed!r} is not an integer in [0, {MAX_SEED}]")
        if not (0.0 <= temperature <= MAX_TEMPERATURE and 0.0 <= top_p <= 1.0):
            raise WireError(f"BEGIN temperature {temperature} or top_p {top_p} is out of range")
        return cls(temperature, top_p, seed, label)


def send(channel: Channel, frame: Frame, sender: range) -> None:
    """Seal and send `frame`, binding it to `sender`'s layer range."""
    channel.send(encode(frame), associated_data(frame.request, sender, frame.step))


def receive(
    channel: Channel,
    timeout_s: float,
    request: int,
    sender: range,
    step: int,
    kinds: tuple[Kind, ...],
) -> Frame:
    """Open the next frame, which must be `request`/`step` from `sender` and one of `kinds`.

    Raises ChannelError (framing.ChannelTimeout when nothing arrived in time) or WireError.
    """
    payload = channel.recv(timeout_s, associated_data(request, sender, step))
    frame = decode(payload)
    if frame.request != request or frame.step != step:
        raise WireError(
            f"frame header says request {frame.request} step {frame.step}, the sealed binding "
            f"says request {request} step {step}"
        )
    if frame.kind not in kinds:
        expected = " or ".join(kind.name for kind in kinds)
        raise WireError(f"expected a {expected} frame for request {request}, got {frame.kind.name}")
    return frame
