"""The lockstep protocol: rank 0 broadcasts commands through `all_sum`; every rank generates alike.

A broadcast is an `all_sum` to which rank 0 contributes the values and every other rank
zeros. All collectives run on mlx-lm's generation stream, so they stay ordered with the
`all_sum`s inside the sharded layers that `generate_step` has already queued.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache

from planner.errors import EngineError

from ..sampling import make_request_sampler

GENERATE = 1
PING = 2
SHUTDOWN = 3
COMMAND_NAMES = {GENERATE: "generate", PING: "ping", SHUTDOWN: "shutdown"}

# [kind, prompt_len, max_tokens, seed lo/hi, temperature lo/hi, top_p lo/hi, sync_every,
#  wait_after_us]
HEADER_SIZE = 11
# Idle ranks must not wait inside a collective: mlx's ring (and JACCL) backends busy-poll
# there, one core per idle rank. Every rank instead sleeps `wait_after` between headers,
# starting short after real work and doubling up to the heartbeat while idle.
FIRST_IDLE_WAIT_S = 0.002
CHECKSUM_MODULUS = 2_147_483_629  # a prime below 2**31: a checksum fits one int32 slot
CHECKSUM_BASE = 1_000_003


class DivergenceError(EngineError):
    """Ranks sampled different tokens: the shards no longer agree, the group is unusable."""


@dataclass(frozen=True, slots=True)
class Command:
    """What rank 0 asks of every rank; a GENERATE carries the whole request."""

    kind: int
    prompt: tuple[int, ...] = ()
    max_tokens: int = 0
    seed: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    sync_every: int = 8
    wait_after_s: float = 0.0  # every rank sleeps this long before the next header


def _words(fmt: str, value: float | int) -> tuple[int, int]:
    """A 64-bit value as two int32 words, so floats cross ranks bit-exact."""
    low, high = struct.unpack("<ii", struct.pack(fmt, value))
    return low, high


def _value(fmt: str, low: int, high: int) -> float | int:
    return struct.unpack(fmt, struct.pack("<ii", low, high))[0]


def encode_header(command: Command) -> list[int]:
    return [
        command.kind,
        len(command.prompt),
        command.max_tokens,
        *_words("<Q", command.seed),
        *_words("<d", command.temperature),
        *_words("<d", command.top_p),
        command.sync_every,
        round(command.wait_after_s * 1e6),
    ]


def decode_header(words: list[int]) -> Command:
    kind, prompt_len, max_tokens, seed_lo, seed_hi, t_lo, t_hi, p_lo, p_hi, sync_every, wait = words
    if kind not in COMMAND_NAMES:
        raise EngineError(f"lockstep header carries unknown command {kind}: ranks are out of step")
    return Command(
        kind=kind,
        prompt=(0,) * prompt_len,  # placeholder length; the tokens follow in their own broadcast
        max_tokens=max_tokens,
        seed=int(_value("<Q", seed_lo, seed_hi)),
        temperature=float(_value("<d", t_lo, t_hi)),
        top_p=float(_value("<d", p_lo, p_hi)),
        sync_every=sync_every,
        wait_after_s=wait / 1e6,
    )


def idle_wait_s(pings_in_a_row: int, heartbeat_s: float) -> float:
    """How long every rank sleeps before the next header: grows while idle, up to heartbeat_s."""
    return min(FIRST_IDLE_WAIT_S * 2**pings_in_a_row, heartbeat_s)


def update_checksum(checksum: int, token: int) -> int:
    """A rolling hash of the tokens so far; equal on every rank while they agree."""
    return (checksum * CHECKSUM_BASE + token + 1) % CHECKSUM_MODULUS


def check_sync(words: list[int], world_size: int) -> bool:
    """Read a summed sync vector [stop, checksum of rank 0, ..., of rank n-1]; True = stop."""
    stop, checksums = words[0], words[1:]
    if len(set(checksums)) != 1:
        differing = [rank for rank, value in enumerate(checksums) if value != checksums[0]]
        raise DivergenceError(
            f"tensor-parallel ranks {differing} sampled different tokens than rank 0 "
            f"(checksums {checksums}); the group must be restarted"
        )
    return stop != 0


class Lockstep:
    """Broadcasts and sync points over one distributed group; rank 0 is the only source."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank = group.rank()
        self.world_size = group.size()

    def sum_across_ranks(self, values: list[int]) -> list[int]:
        """One int32 `all_sum` on the generation stream, evaluated now."""
        with mx.stream(generation_stream):
            total = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=self.group)
            mx.eval(total)
        return total.tolist()

    def broadcast(self, values: list[int], size: int) -> list[int]:
        """Rank 0's `values` (length `size`) on every rank; other ranks pass anything."""
        return self.sum_across_ranks(list(values) if self.rank == 0 else [0] * size)

    def broadcast_command(self, command: Command | None = None) -> Command:
        """Rank 0 sends `command`; every other rank blocks here until the next one arrives."""
        header = encode_header(command) if self.rank == 0 else []
        received = decode_header(self.broadcast(header, HEADER_SIZE))
        if received.kind != GENERATE:
            return received
        prompt = command.prompt if command is not None else ()
        tokens = self.broadcast(list(prompt), len(received.prompt)) if received.prompt else []
        return replace(received, prompt=tuple(tokens))

    def sync(self, stop: bool, checksum: int) -> bool:
        """Meet every rank: agree on rank 0's stop flag and compare token checksums."""
        words = [0] * (1 + self.world_size)
        if self.rank == 0:
            words[0] = int(stop)
        words[1 + self.rank] = checksum
        return check_sync(self.sum_across_ranks(words), self.world_size)


def generate_in_lockstep(
    model: object,
    command: Command,
    lockstep: Lockstep,
    eos_token_ids: Collection[int],
    on_token: Callable[[int], None],
    stop_requested: Callable[[], bool],
) -> str:
    """Run one request on this rank's shard; every rank returns the same reason.

    Returns "eos", "length" or "stopped". EOS and max_tokens are decided by every rank
    from identical tokens; rank 0's stop flag only takes effect at a sync point (every
    `sync_every` tokens), which is also where a divergence would be caught.
    """
    sampler = make_request_sampler(command.temperature, command.top_p, command.seed)
    prompt = mx.array(command.prompt, dtype=mx.uint32)
    steps = generate_step(
        prompt,
        model,
        max_tokens=command.max_tokens,
        sampler=sampler,
        prompt_cache=make_prompt_cache(model),
    )
    checksum = 0
    reason = "length"
    try:
        for count, (token, _) in enumerate(steps, start=1):
            token = int(token)
            checksum = update_checksum(checksum, token)
            on_token(token)
            if token in eos_token_ids:
                reason = "eos"
                break
            if count >= command.max_tokens:
                break
            if count % command.sync_every == 0 and lockstep.sync(stop_requested(), checksum):
                reason = "stopped"
                break
    finally:
        steps.close()
    # generate_step queued one more forward pass (with its all_sums) before yielding the
    # last token; finish it here so the next broadcast cannot overtake it.
    mx.synchronize(generation_stream)
    return reason
