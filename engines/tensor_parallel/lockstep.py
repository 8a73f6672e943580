"""The lockstep protocol: rank 0 broadcasts each step's batch changes through `all_sum`.

A broadcast is an `all_sum` to which rank 0 contributes the values and every other rank
zeros. Before every step rank 0 sends one header and, when the batch changes, a payload
listing the removed uids and the inserted sequences (each its GenerationRequest's document, as
JSON bytes packed in the words); every rank then makes the same calls on its own shard, so every
rank holds the same batch. All collectives run on mlx-lm's generation stream, so they stay
ordered with the `all_sum`s inside the sharded layers that the batch generator has already
queued.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, replace

import mlx.core as mx
from mlx_lm.generate import generation_stream

from engines.core.request import GenerationRequest
from errors import EngineError, RequestError

STEP = 1
PING = 2
SHUTDOWN = 3
COMMAND_NAMES = {STEP: "step", PING: "ping", SHUTDOWN: "shutdown"}

# [kind, payload words, advance (step the batch) 0/1, sync after this step 0/1, wait_after_us]
HEADER_SIZE = 5
# per inserted sequence: uid, prefix-cache entry (-1 = none), cached tokens taken from it, the
# length in bytes of its request's JSON document, then that document, 4 bytes to a word
# (little-endian, the last word zero-padded); the request holds the whole prompt (a rank that
# finds the entry unusable prefills all of it) and its seed is set
INSERT_FIELDS = 4
# Entry ids: a kept sequence's uid (the runner counts up from 0), or, for entries no sequence
# names (prompts kept for shared prefill, entries a previous run left on disk), ids counting
# down from here; the two never meet.
TOP_ENTRY_ID = 2**31 - 1
BYTES_PER_WORD = 4
# Idle ranks must not wait inside a collective: mlx's ring (and JACCL) backends busy-poll
# there, one core per idle rank. Every rank instead sleeps `wait_after` between headers,
# starting short after real work and doubling up to the heartbeat while idle.
FIRST_IDLE_WAIT_S = 0.002
# ... but only after rank 0 waited this long for the engine's next step without one coming.
NEXT_STEP_GRACE_S = 0.05
CHECKSUM_MODULUS = 2_147_483_629  # a prime below 2**31: a checksum fits one int32 slot
CHECKSUM_BASE = 1_000_003


class DivergenceError(EngineError):
    """Ranks sampled different tokens: the shards no longer agree, the group is unusable."""


@dataclass(frozen=True, slots=True)
class Insert:
    """A sequence joining the batch, exactly as every rank must insert it."""

    uid: int
    request: GenerationRequest  # its prompt: only the tokens after the cached prefix
    entry: int = -1  # start from this prefix-cache entry (-1: from nothing) ...
    cached: int = 0  # ... its first `cached` tokens


@dataclass(frozen=True, slots=True)
class Command:
    """What rank 0 asks of every rank before a step."""

    kind: int
    inserts: tuple[Insert, ...] = ()
    removes: tuple[int, ...] = ()
    evicts: tuple[int, ...] = ()  # prefix-cache entries every rank drops, after the inserts
    advance: bool = True  # False: apply the batch changes only (nothing left to step)
    sync: bool = False  # compare token checksums after this step
    wait_after_s: float = 0.0  # every rank sleeps this long before the next header
    spills: tuple[int, ...] = ()  # prefix-cache entries every rank moves to its disk tier
    # (uid, entry): every rank keeps that running sequence's prompt KV as that entry, first
    keeps: tuple[tuple[int, int], ...] = ()


def request_words(request: GenerationRequest) -> tuple[int, list[int]]:
    """(byte length, int32 words) of the request's JSON document: 4 bytes to a word, the last
    zero-padded. JSON numbers round-trip exactly, so floats cross ranks bit-exact."""
    data = json.dumps(request.document(), separators=(",", ":")).encode()
    padded = data + bytes(-len(data) % BYTES_PER_WORD)
    return len(data), list(struct.unpack(f"<{len(padded) // BYTES_PER_WORD}i", padded))


def request_of(length: int, words: list[int]) -> GenerationRequest:
    """The request `request_words` encoded, checked (ValueError or RequestError if not one)."""
    count = -(-length // BYTES_PER_WORD)
    if length <= 0 or len(words) != count:
        raise ValueError(f"a {length}-byte request document needs {count} words, got {len(words)}")
    data = struct.pack(f"<{count}i", *words)[:length]
    return GenerationRequest.from_document(json.loads(data))


def encode_payload(command: Command) -> list[int]:
    words = [len(command.removes), *command.removes, len(command.inserts)]
    for insert in command.inserts:
        length, document = request_words(insert.request)
        words += [insert.uid, insert.entry, insert.cached, length, *document]
    words += [len(command.evicts), *command.evicts, len(command.spills), *command.spills]
    return words + [len(command.keeps), *(word for keep in command.keeps for word in keep)]


def decode_payload(words: list[int]) -> Command:
    """A step command's removes, inserts, evicts, spills and keeps from its payload (its
    header fields left at their defaults); malformed means the ranks are out of step."""
    try:
        count = words[0]
        removes = tuple(words[1 : 1 + count])
        at = 1 + count
        inserts = []
        for _ in range(words[at]):
            uid, entry, cached, length = words[at + 1 : at + 1 + INSERT_FIELDS]
            at += INSERT_FIELDS
            count = -(-length // BYTES_PER_WORD)
            request = request_of(length, words[at + 1 : at + 1 + count])
            at += count
            inserts.append(Insert(uid, request, entry, cached))
        at += 1
        evicts = tuple(words[at + 1 : at + 1 + words[at]])
        at += len(evicts) + 1
        spills = tuple(words[at + 1 : at + 1 + words[at]])
        at += len(spills) + 1
        pairs = words[at + 1 : at + 1 + 2 * words[at]]
        if len(pairs) != 2 * words[at]:
            raise ValueError(f"{words[at]} keeps need {2 * words[at]} words, got {len(pairs)}")
        keeps = tuple(zip(pairs[::2], pairs[1::2], strict=True))
        at += len(pairs)
    # UnicodeDecodeError and json's JSONDecodeError are ValueErrors
    except (IndexError, ValueError, RequestError, struct.error) as error:
        raise EngineError(f"malformed lockstep payload ({error}): ranks are out of step") from None
    if at + 1 != len(words):
        raise EngineError("lockstep payload has trailing words: ranks are out of step")
    return Command(STEP, tuple(inserts), removes, evicts, spills=spills, keeps=keeps)


def encode_header(command: Command, payload_words: int) -> list[int]:
    return [
        command.kind,
        payload_words,
        int(command.advance),
        int(command.sync),
        round(command.wait_after_s * 1e6),
    ]


def decode_header(words: list[int]) -> tuple[Command, int]:
    """The command (without its payload) and the number of payload words that follow."""
    kind, payload_words, advance, sync, wait = words
    if kind not in COMMAND_NAMES:
        raise EngineError(f"lockstep header carries unknown command {kind}: ranks are out of step")
    command = Command(kind, advance=bool(advance), sync=bool(sync), wait_after_s=wait / 1e6)
    return command, payload_words


def idle_wait_s(pings_in_a_row: int, heartbeat_s: float) -> float:
    """How long every rank sleeps before the next header: grows while idle, up to heartbeat_s.

    The exponent is capped: after ~1,000 idle pings (a quarter of an hour) 2**n as a float
    would overflow and end the group.
    """
    return min(FIRST_IDLE_WAIT_S * 2 ** min(pings_in_a_row, 64), heartbeat_s)


def ping_after_s(command: Command) -> float:
    """How long rank 0 waits for the engine's next command before it pings, after `command`.
    After a step the next one is a few ms away (the engine reads these tokens first): a ping
    then would send every rank to sleep, and that step would wait for them to wake."""
    return NEXT_STEP_GRACE_S if command.kind == STEP else command.wait_after_s


def update_checksum(checksum: int, token: int) -> int:
    """A rolling hash of the tokens so far; equal on every rank while they agree."""
    return (checksum * CHECKSUM_BASE + token + 1) % CHECKSUM_MODULUS


def check_sync(checksums: list[int]) -> None:
    """Raise DivergenceError unless every rank's checksum equals rank 0's."""
    if len(set(checksums)) != 1:
        differing = [rank for rank, value in enumerate(checksums) if value != checksums[0]]
        raise DivergenceError(
            f"tensor-parallel ranks {differing} sampled different tokens than rank 0 "
            f"(checksums {checksums}); the group must be restarted"
        )


class Lockstep:
    """Broadcasts and sync points over one distributed group; rank 0 is the only source."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank = group.rank()
        self.world_size = group.size()
        # Seconds spent in this object's all_sums so far, waits for slower ranks included
        # (the step timing: engines/tensor_parallel/step_clock.py).
        self.seconds = 0.0

    def sum_across_ranks(self, values: list[int]) -> list[int]:
        """One int32 `all_sum` on the generation stream, evaluated now."""
        started = time.perf_counter()
        with mx.stream(generation_stream):
            total = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=self.group)
            mx.eval(total)
        self.seconds += time.perf_counter() - started
        return total.tolist()

    def broadcast(self, values: list[int], size: int) -> list[int]:
        """Rank 0's `values` (length `size`) on every rank; other ranks pass anything."""
        return self.sum_across_ranks(list(values) if self.rank == 0 else [0] * size)

    def broadcast_command(self, command: Command | None = None) -> Command:
        """Rank 0 sends `command`; every other rank blocks here until the next one arrives."""
        payload = encode_payload(command) if self.rank == 0 and command.kind == STEP else []
        header = encode_header(command, len(payload)) if self.rank == 0 else []
        received, payload_words = decode_header(self.broadcast(header, HEADER_SIZE))
        if not payload_words:
            return received
        changes = decode_payload(self.broadcast(payload, payload_words))
        return replace(
            changes,
            kind=received.kind,
            advance=received.advance,
            sync=received.sync,
            wait_after_s=received.wait_after_s,
        )

    def sync(self, checksum: int) -> None:
        """Meet every rank and compare token checksums (a divergence ends the group)."""
        words = [0] * self.world_size
        words[self.rank] = checksum
        check_sync(self.sum_across_ranks(words))
