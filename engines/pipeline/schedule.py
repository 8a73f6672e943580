"""The coordinator's micro-batch schedule: which frames go down the pipeline, and what comes back.

Plain bookkeeping, no mlx and no sockets: engine.py runs stage 0 over the frames planned here
and sends them; every HIDDEN frame comes back as exactly one answer, in the order sent (each
hop is one ordered stream), so the frames in flight are a queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engines.pipeline.wire import PREFILL_GROUP, Row
from engines.speculation.lane import accepted_prefix
from planner.memory import quantizes_at

Drafts = Callable[[int], list[int]]  # a lone decoding sequence's uid -> the tokens it drafts


@dataclass(frozen=True, slots=True)
class Planned:
    """A HIDDEN frame to run through stage 0 and send: its rows and their input tokens."""

    group: int
    step: int
    rows: tuple[Row, ...]
    tokens: tuple[int, ...]  # decode: one per row (then the draft); prefill: the chunk
    begins: tuple[int, ...] = ()  # uids whose BEGIN must go down before this frame
    last_chunk: bool = False  # a prefill chunk ending its prompt: it samples the first token
    draft: tuple[int, ...] = ()  # a verifying pass: the one row's drafted tokens

    @property
    def is_prefill(self) -> bool:
        return self.group == PREFILL_GROUP

    @property
    def verifies(self) -> bool:
        return bool(self.draft)


@dataclass(slots=True)
class _Sequence:
    uid: int
    prompt: tuple[int, ...]
    cached: int = 0  # prompt tokens the stages start with, from a prefix-cache entry
    prefilled: int = 0  # prompt tokens sent down in prefill chunks
    position: int = 0  # tokens the stages' caches hold once every sent frame is processed
    next_token: int | None = None  # the next decode input; None while its answer is out
    group: int | None = None  # None until its first token is back
    begun: bool = False  # BEGIN went down: the stages know it and must be told when it ends
    held: bool = False  # waits for its prefix-cache entry to be read back from disk
    generated: list[int] = field(default_factory=list)  # tokens answered so far


@dataclass(slots=True)
class _Group:
    members: list[int] = field(default_factory=list)
    steps: int = 0
    in_flight: bool = False


class MicroBatchSchedule:
    """Sequences in `groups` decode micro-batches, prefilled one chunk at a time in between.

    A micro-batch is sent when its previous answer is back, so with one micro-batch per stage
    every stage can work at once. A newcomer's prompt goes down in chunks of `prefill_chunk`:
    while others decode, at most a chunk's worth of tokens at a time, so a long prompt delays
    each of their tokens by one chunk (as SingleEngine's one chunk per step) and short prompts
    arriving together go down together; while nobody decodes, up to `prefill_in_flight`
    chunks fill the pipeline. Newcomers take turns, a chunk each. The last
    chunk, ending the prompt, comes back with the first token (as SingleEngine computes the
    rest of a prompt and samples in one pass); the newcomer then joins the smallest
    micro-batch, that token as its input. A sequence starting from a prefix-cache entry of
    `cached` tokens is prefilled from there (positions start at `cached`).

    With `quantized_kv_start` (KV quantized as mlx-lm does: after the pass that leaves a cache
    at that many tokens), a prompt whose all-but-last tokens reach it sends its last token
    alone, as mlx-lm's generate_step: that token attends over the quantized cache.

    A sequence decoding alone (no other is scheduled) may verify a draft: its frame feeds its
    next token and the drafted tokens after it, and the answer has a token per position. It
    keeps the drafted tokens the model agrees with and the model's own next one, and its
    position goes back to what it kept: every stage trims the rest when its next frame comes.
    """

    def __init__(
        self,
        groups: int,
        prefill_chunk: int,
        prefill_in_flight: int,
        quantized_kv_start: int | None = None,
    ) -> None:
        if groups < 1 or groups >= PREFILL_GROUP or prefill_chunk < 1 or prefill_in_flight < 1:
            raise ValueError(
                f"invalid schedule: groups={groups}, prefill_chunk={prefill_chunk}, "
                f"prefill_in_flight={prefill_in_flight}"
            )
        self.prefill_chunk = prefill_chunk
        self.prefill_in_flight = prefill_in_flight
        self.quantized_kv_start = quantized_kv_start
        self._groups = [_Group() for _ in range(groups)]
        self._sequences: dict[int, _Sequence] = {}
        self._prefilling: deque[int] = deque()  # uids in arrival order
        self._prefill_steps = 0
        self._in_flight: deque[Planned] = deque()

    # -- membership --------------------------------------------------------------------------

    def add(self, uid: int, prompt: Sequence[int], cached: int = 0, held: bool = False) -> None:
        """Schedule a sequence whose caches start with the prompt's first `cached` tokens;
        a `held` one waits for release() (or start_cold()) before any of its frames."""
        if uid in self._sequences or not prompt:
            raise ValueError(f"sequence {uid} is already scheduled or has an empty prompt")
        if not 0 <= cached < len(prompt):
            raise ValueError(f"sequence {uid}: {cached} cached of {len(prompt)} prompt tokens")
        sequence = _Sequence(uid, tuple(prompt), cached, prefilled=cached, position=cached)
        self._sequences[uid] = sequence
        sequence.held = held
        if not held:
            self._queue(sequence)

    def release(self, uid: int) -> None:
        """A held sequence may go: its entry is ready on every stage."""
        sequence = self._sequences[uid]
        if sequence.held:
            sequence.held = False
            self._queue(sequence)

    def start_cold(self, uid: int) -> None:
        """A sequence not begun yet starts with empty caches after all (its entry is gone)."""
        sequence = self._sequences[uid]
        if sequence.begun:
            raise ValueError(f"sequence {uid} has begun: its caches are on the stages")
        if uid in self._prefilling:  # (one not begun has no first token, so no group)
            self._prefilling.remove(uid)
        sequence.held = False
        sequence.cached = sequence.prefilled = sequence.position = 0
        self._queue(sequence)

    def cached(self, uid: int) -> int:
        return self._sequences[uid].cached

    def tokens(self, uid: int) -> tuple[int, ...]:
        """The prompt and every token answered so far (a prefix of them is in the caches)."""
        sequence = self._sequences[uid]
        return sequence.prompt + tuple(sequence.generated)

    def produced(self, uid: int) -> int:
        """Tokens answered for `uid` so far."""
        return len(self._sequences[uid].generated)

    def position(self, uid: int) -> int:
        """Tokens the stages' caches hold for `uid` once every sent frame is processed."""
        return self._sequences[uid].position

    def _queue(self, sequence: _Sequence) -> None:
        self._prefilling.append(sequence.uid)  # at least the prompt's last token is left

    def remove(self, uids: Sequence[int]) -> list[int]:
        """Forget `uids`; returns those the stages know (their caches must be freed)."""
        known = []
        for uid in uids:
            sequence = self._sequences.pop(uid, None)
            if sequence is None:
                continue
            if sequence.begun:
                known.append(uid)
            if sequence.group is not None:
                self._groups[sequence.group].members.remove(uid)
            elif uid in self._prefilling:
                self._prefilling.remove(uid)
        return known

    def clear(self) -> None:
        """The chain was lost: every sequence and frame in flight is gone."""
        self._sequences.clear()
        self._prefilling.clear()
        for group in self._groups:
            group.members.clear()
        self.restart()

    def restart(self) -> None:
        """A fresh session: nothing in flight, every micro-batch counts its steps from 1.

        Only while no sequence has begun (the new session's stages know none)."""
        if any(sequence.begun for sequence in self._sequences.values()):
            raise ValueError("a session cannot restart under sequences the old one knew")
        self._in_flight.clear()
        self._prefill_steps = 0
        for group in self._groups:
            group.steps = 0
            group.in_flight = False

    def __contains__(self, uid: int) -> bool:
        return uid in self._sequences

    @property
    def active(self) -> int:
        return len(self._sequences)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def groups(self) -> int:
        return len(self._groups)

    def sizes(self) -> list[int]:
        return [len(group.members) for group in self._groups]

    # -- planning ----------------------------------------------------------------------------

    def plan(self, drafts: Drafts | None = None) -> list[Planned]:
        """The frames to send now, in order; they count as in flight from here on. `drafts`
        gives the draft of a sequence decoding alone (none: it decodes plainly)."""
        frames = self._plan_decodes(drafts)
        frames += self._plan_prefills(decoding=bool(frames) or self._decoding())
        frames += self._plan_decodes(drafts)  # a newcomer may have joined an idle micro-batch
        self._in_flight.extend(frames)
        return frames

    def expected(self) -> Planned | None:
        """The frame whose answer comes back next."""
        return self._in_flight[0] if self._in_flight else None

    def answered(self, tokens: Sequence[int]) -> list[tuple[int, int]]:
        """The next answer arrived: (uid, token) for the rows still scheduled."""
        frame = self._in_flight.popleft()
        if frame.is_prefill and not frame.last_chunk:
            return []
        if not frame.is_prefill:
            self._groups[frame.group].in_flight = False
        if frame.verifies:
            return self._verified(frame, tokens)
        produced = []
        for row, token in zip(frame.rows, tokens, strict=True):
            sequence = self._sequences.get(row.uid)
            if sequence is not None:  # else removed while its token was on the way
                sequence.next_token = token
                sequence.generated.append(token)
                produced.append((row.uid, token))
                if frame.is_prefill:  # its first token: from now on it decodes
                    self._join(sequence)
        return produced

    def _verified(self, frame: Planned, tokens: Sequence[int]) -> list[tuple[int, int]]:
        """A verifying pass answered: the tokens kept, and the position after them."""
        row = frame.rows[0]
        if len(tokens) != len(frame.tokens):
            raise ValueError(f"a pass verifying {len(frame.tokens)} positions got {len(tokens)}")
        sequence = self._sequences.get(row.uid)
        if sequence is None:  # removed while its pass was on the way
            return []
        kept = accepted_prefix(list(tokens), list(frame.draft))
        sequence.position = row.position + len(kept)  # the stages trim the rest
        sequence.next_token = kept[-1]
        sequence.generated.extend(kept)
        return [(row.uid, token) for token in kept]

    def _decoding(self) -> bool:
        return any(group.members for group in self._groups)

    def _plan_decodes(self, drafts: Drafts | None) -> list[Planned]:
        frames = []
        for index, group in enumerate(self._groups):
            if group.in_flight or not group.members:
                continue
            draft = self._draft(group, drafts)
            rows, tokens = [], []
            for uid in group.members:
                sequence = self._sequences[uid]
                rows.append(Row(uid, sequence.position))
                tokens += [sequence.next_token, *draft]
                sequence.position += 1 + len(draft)
                sequence.next_token = None
            group.steps += 1
            group.in_flight = True
            begins = self._take_begins(group.members)
            rows, tokens = tuple(rows), tuple(tokens)
            frames.append(Planned(index, group.steps, rows, tokens, begins, draft=draft))
        return frames

    def _draft(self, group: _Group, drafts: Drafts | None) -> tuple[int, ...]:
        """The draft of a micro-batch's one member when it is the only sequence scheduled."""
        if drafts is None or len(self._sequences) != 1 or len(group.members) != 1:
            return ()
        return tuple(drafts(group.members[0]))

    def _plan_prefills(self, decoding: bool) -> list[Planned]:
        frames: list[Planned] = []
        out = [frame for frame in self._in_flight if frame.is_prefill]
        count, tokens = len(out), sum(len(frame.tokens) for frame in out)
        while self._prefilling:
            sequence = self._sequences[self._prefilling[0]]
            body = self._body(sequence)
            if sequence.prefilled == body:  # the body is down: the last token alone
                body = len(sequence.prompt)
            start, stop = sequence.prefilled, min(sequence.prefilled + self.prefill_chunk, body)
            if not self._prefill_fits(decoding, count, tokens + stop - start):
                break
            self._prefill_steps += 1
            row = Row(sequence.uid, start)
            begins = self._take_begins([sequence.uid])
            chunk, last = sequence.prompt[start:stop], stop == len(sequence.prompt)
            step = self._prefill_steps
            frames.append(Planned(PREFILL_GROUP, step, (row,), chunk, begins, last_chunk=last))
            count, tokens = count + 1, tokens + len(chunk)
            sequence.prefilled = sequence.position = stop
            self._prefilling.popleft()
            if not last:  # round robin: a short prompt behind a long one waits one chunk, not all
                self._prefilling.append(sequence.uid)
        return frames

    def _body(self, sequence: _Sequence) -> int:
        """The prompt tokens its chunks cover before the chunk that samples the first token:
        all but the last when the KV cache is quantized after them (as mlx-lm's), else all."""
        length, start = len(sequence.prompt), self.quantized_kv_start
        if start is None or not quantizes_at(length - 1, start) or sequence.prefilled == length:
            return length
        return length - 1

    def _prefill_fits(self, decoding: bool, frames: int, tokens: int) -> bool:
        """Whether `frames` prefill frames of `tokens` in all may be out at once: while others
        decode, a chunk's worth of tokens (the delay a decoding sequence accepts per token;
        short prompts arriving together share it, instead of a trip around the pipeline each);
        while nobody decodes, `prefill_in_flight` frames, one per stage (stage 0 runs every
        frame it plans before it reads an answer: more would hold back the first token)."""
        if decoding:
            return tokens <= self.prefill_chunk
        return frames < self.prefill_in_flight

    def _join(self, sequence: _Sequence) -> None:
        """Into the smallest micro-batch (an idle one on a tie), its first token as input."""
        index = min(
            range(len(self._groups)),
            key=lambda i: (len(self._groups[i].members), self._groups[i].in_flight, i),
        )
        sequence.group = index
        self._groups[index].members.append(sequence.uid)

    def _take_begins(self, uids: Sequence[int]) -> tuple[int, ...]:
        fresh = []
        for uid in uids:
            sequence = self._sequences[uid]
            if not sequence.begun:
                sequence.begun = True
                fresh.append(uid)
        return tuple(fresh)
