"""One stage's KV caches per sequence (alone while prefilling, then inside its micro-batch),
and this stage's share of the prefix cache."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from engines.pipeline.stage_model import StageModel
from engines.pipeline.wire import PREFILL_GROUP, Row, WireError
from engines.prefix_cache.disk_tier import DiskTier, DiskUnreadable
from engines.prefix_cache.store import PrefixStore
from errors import EngineError

MAX_GROUPS = 256  # decode micro-batches a stage accepts (the coordinator uses one per stage)


@dataclass(slots=True)
class _Group:
    """A decode micro-batch: its members in row order and their batched (left-padded) caches."""

    members: list[int] = field(default_factory=list)
    caches: list[Any] | None = None  # one mlx-lm BatchKVCache per layer, rows = members


class StageBatches:
    """Runs frames over the right caches and refuses rows that do not match them.

    The coordinator decides who is in which micro-batch; a stage follows, checking each frame
    against what it holds: a decode frame lists the micro-batch's members in order, then
    newcomers whose prefill is done; every row's position is the length of its KV cache here;
    every micro-batch's steps count 1, 2, 3, ... As in mlx-lm's BatchGenerator, a newcomer is
    prefilled in a batch of its own and then merged (left-padded) into its micro-batch.

    A sequence alone in its micro-batch may verify a draft: several positions in one decode
    frame. Its next frame (or the END keeping it) then names a position behind what is held
    here: the rejected positions, which roll_back() trims. Only then may a position go back,
    and by no more than that pass's positions after its first.

    `prefix` holds this stage's layers of every prefix-cache entry; the coordinator's index
    decides which entries exist, and the stage refuses a frame naming one it does not hold.
    With a `disk` tier (this machine's, for this stage's layers) entries can be spilled there.
    """

    def __init__(self, stage: StageModel, disk: DiskTier | None = None) -> None:
        self.stage = stage
        self.prefix = PrefixStore(disk)
        self._alone: dict[int, list[Any]] = {}  # uid -> caches of a sequence still prefilling
        self._positions: dict[int, int] = {}  # uid -> tokens in its KV caches here
        self._groups: dict[int, _Group] = {}
        self._group_of: dict[int, int] = {}
        self._steps: dict[int, int] = {}  # group -> its last step
        # uid -> positions its last pass, a verifying one, may have had rejected
        self._rejectable: dict[int, int] = {}
        self.prefilled_tokens = 0  # prompt tokens run through these layers in prefill chunks

    @property
    def active(self) -> int:
        return len(self._positions)

    def begin(self, uid: int, position: int = 0, entry: int | None = None) -> None:
        """A new sequence: empty caches, or the first `position` tokens of prefix entry `entry`."""
        if uid in self._positions:
            raise WireError(f"sequence {uid} began twice")
        if entry is None:
            if position != 0:
                raise WireError(f"sequence {uid} begins at {position} without a prefix entry")
            caches = self.stage.make_cache()
        else:
            if entry not in self.prefix:
                raise WireError(f"sequence {uid} begins from prefix entry {entry}, not held here")
            try:
                caches, _ = self.prefix.take_prefix(entry, position)
            except (EngineError, DiskUnreadable) as error:  # a length it does not hold, a bad file
                raise WireError(f"sequence {uid}: {error}") from None
            caches = self.stage.adopt_cache(caches)
        self._alone[uid] = [type(cache).merge([cache]) for cache in caches]
        self._positions[uid] = position

    def position(self, uid: int) -> int:
        """Tokens in the caches of `uid` here (0 for a sequence not held)."""
        return self._positions.get(uid, 0)

    def keep(
        self,
        uid: int,
        tokens: int,
        token_ids: Sequence[int] | None = None,
        entry: int | None = None,
    ) -> int:
        """Keep the caches of `uid` as prefix entry `entry` (default: `uid`, before end());
        returns their bytes. A running sequence goes on from its own caches (mlx arrays are
        values: its next writes do not reach the entry).

        `tokens` must be its cache length here. `token_ids`: what the cache holds, which only
        the coordinator knows; the other stages never see token ids and keep zeros (the index
        on the coordinator matches prompts, a stage only needs the count)."""
        entry = uid if entry is None else entry
        held = self._positions.get(uid)
        behind = held is not None and 0 < held - tokens <= self._rejectable.get(uid, 0)
        if held is None or (held != tokens and not behind):
            raise WireError(f"keep sequence {uid} of {tokens} tokens: this stage holds {held}")
        if entry in self.prefix:
            raise WireError(f"prefix entry {entry} exists already")
        alone = self._alone.get(uid)
        if alone is not None:  # ended while prefilling: its own one-row batch
            caches = [cache.extract(0) for cache in alone]
        else:
            batch = self._groups[self._group_of[uid]]
            row = batch.members.index(uid)
            caches = [cache.extract(row) for cache in batch.caches]
        if behind:  # ended right after a verifying pass: its rejected positions go
            _trim(caches, held - tokens, uid)
        ids = token_ids if token_ids is not None else (0,) * tokens
        return self.prefix.put(entry, caches, ids)

    def drop(self, entries: Iterable[int]) -> None:
        """Forget prefix entries (unknown ids are ignored: an entry may not have been kept)."""
        self.prefix.drop(entries)

    def spill(self, entries: Iterable[int]) -> None:
        """Move prefix entries to the disk tier (written in the background), or drop them."""
        self.prefix.spill(entries)

    def load(self, entries: Iterable[int]) -> list[int]:
        """Read entries on disk back for the sequences about to begin from them; returns
        those this stage cannot give (not held, or a torn or corrupt file): misses."""
        unreadable = []
        for entry in entries:
            try:
                self.prefix.load(entry)
            except DiskUnreadable:
                unreadable.append(entry)
        return unreadable

    def check_step(self, group: int, step: int) -> None:
        """Each micro-batch's frames arrive as steps 1, 2, 3, ...: no replay, none skipped."""
        if group != PREFILL_GROUP and group >= MAX_GROUPS:
            raise WireError(f"micro-batch {group} is out of range (at most {MAX_GROUPS})")
        expected = self._steps.get(group, 0) + 1
        if step != expected:
            raise WireError(f"micro-batch {group} sent step {step}, expected step {expected}")
        self._steps[group] = step

    def prefill(self, row: Row, hidden: mx.array) -> mx.array:
        """Run a prefill chunk (1, L, D) of one sequence over its own caches."""
        caches = self._alone.get(row.uid)
        if caches is None:
            raise WireError(f"prefill chunk for sequence {row.uid}, which is not prefilling here")
        self._check_position(row)
        hidden = self.stage.forward(hidden, caches)  # (1, L, D)
        self._positions[row.uid] += hidden.shape[1]
        self.prefilled_tokens += hidden.shape[1]
        return hidden

    def roll_back(self, group: int, rows: Sequence[Row]) -> dict[int, int]:
        """Before a decode frame: trim the positions a lone member's last verifying pass
        rejected (its row names fewer than held here); returns uid -> positions trimmed."""
        batch = self._groups.get(group)
        if batch is None or len(batch.members) != 1 or not rows:
            return {}
        uid, row = batch.members[0], rows[0]
        rejected = self._positions[uid] - row.position
        if row.uid != uid or not 0 < rejected <= self._rejectable.pop(uid, 0):
            return {}  # (a position behind is then refused as any other mismatch)
        _trim(batch.caches, rejected, uid)
        self._positions[uid] = row.position
        return {uid: rejected}

    def decode(self, group: int, rows: Sequence[Row], hidden: mx.array) -> mx.array:
        """Run one decode step (B, 1, D) of micro-batch `group`, merging newcomers first; a
        verifying pass (1, L, D) of a micro-batch of one advances its position by L."""
        batch = self._groups.setdefault(group, _Group())
        uids = [row.uid for row in rows]
        held = len(batch.members)
        if uids[:held] != batch.members:
            raise WireError(
                f"micro-batch {group} holds sequences {batch.members} here, the frame's rows "
                f"are {uids}"
            )
        newcomers = uids[held:]
        for uid in newcomers:
            if uid not in self._alone:
                raise WireError(
                    f"row {uid} of micro-batch {group} is neither in it nor a prefilled newcomer"
                )
        for row in rows:
            self._check_position(row)
        if hidden.shape[1] > 1 and len(uids) != 1:  # (its first decode frame may verify)
            raise WireError(f"a verifying pass of micro-batch {group} for sequences {uids}")
        for uid in newcomers:
            batch.caches = _extend(batch.caches, self._alone.pop(uid))
            batch.members.append(uid)
            self._group_of[uid] = group
        hidden = self.stage.forward(hidden, batch.caches)  # (B, L, D)
        for uid in uids:
            self._positions[uid] += hidden.shape[1]
            self._rejectable.pop(uid, None)
        if hidden.shape[1] > 1:  # a verifying pass: all but its first position may go
            self._rejectable[uids[0]] = hidden.shape[1] - 1
        return hidden

    def end(self, uids: Sequence[int]) -> None:
        """Free the caches of `uids` (unknown uids are ignored: they may never have begun)."""
        leaving: dict[int, set[int]] = {}
        for uid in uids:
            self._positions.pop(uid, None)
            self._rejectable.pop(uid, None)
            self._alone.pop(uid, None)
            group = self._group_of.pop(uid, None)
            if group is not None:
                leaving.setdefault(group, set()).add(uid)
        for group, gone in leaving.items():
            batch = self._groups[group]
            keep = [index for index, uid in enumerate(batch.members) if uid not in gone]
            batch.members = [batch.members[index] for index in keep]
            if not keep:
                batch.caches = None
            else:
                for cache in batch.caches:
                    cache.filter(keep)

    def caches_of(self, group: int) -> list[Any]:
        """Every layer's cache state of a micro-batch, for mx.eval."""
        batch = self._groups.get(group)
        return [] if batch is None or batch.caches is None else [c.state for c in batch.caches]

    def prefill_caches_of(self, uid: int) -> list[Any]:
        return [cache.state for cache in self._alone.get(uid, [])]

    def _check_position(self, row: Row) -> None:
        held = self._positions[row.uid]
        if row.position != held:
            raise WireError(
                f"sequence {row.uid} holds {held} tokens here, the frame says {row.position}"
            )


def _trim(caches: list[Any], count: int, uid: int) -> None:
    """Take the last `count` positions off caches that can give them back."""
    if not can_trim_prompt_cache(caches):
        raise WireError(f"sequence {uid} goes back {count} positions: its caches cannot trim")
    trim_prompt_cache(caches, count)


def _extend(caches: list[Any] | None, newcomer: list[Any]) -> list[Any]:
    """Append a newcomer's rows to a micro-batch's caches, layer by layer (mlx-lm's extend)."""
    if caches is None:
        return newcomer
    for cache, other in zip(caches, newcomer, strict=True):
        cache.extend(other)
    return caches
