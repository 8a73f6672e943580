"""ShardBatch: one rank's copy of the batch, advanced by the commands every rank receives."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from engines.core.engine import DEFAULT_PREFILL_CHUNK, StepOutput
from engines.decoding.decode_batch import DecodeBatch
from engines.decoding.sampling import make_request_processors, make_request_sampler
from engines.prefix_cache.disk_tier import DiskTier, DiskUnreadable
from engines.prefix_cache.store import PrefixStore, reusable
from engines.tensor_parallel.lockstep import Command, Insert, update_checksum
from engines.tensor_parallel.rank_grammar import RankGrammars
from errors import EngineError
from planner.memory import DEFAULT_QUANTIZED_KV_START

log = logging.getLogger(__name__)


class ShardBatch:
    """This rank's DecodeBatch (mlx-lm's BatchGenerator over its shard), driven only by
    lockstep commands.

    Every rank applies the same removes and inserts in the same order and steps the same
    number of times, so the generators assign the same uids, run the same sharded forward
    passes (whose `all_sum`s meet across ranks), and sample the same tokens.

    With `keep_prefixes`, every sequence that ends leaves its KV shard in this rank's prefix
    store under its uid, and a command's keeps leave a running sequence's prompt KV under the
    entry id they name (shared prefill); rank 0's engine indexes them (from `drain_kept`) and
    names the entries to start from and to drop in later commands. An insert whose entry any
    rank cannot use prefills its whole prompt on every rank (`drain_missed` reports it).

    A sequence with a grammar gets `grammars.processor(grammar)` last among its logits
    processors, as in the single engine: every rank masks the same tokens, so every rank
    still samples the same one.
    """

    def __init__(
        self,
        model: Any,
        max_batch: int,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        keep_prefixes: bool = False,
        grammars: RankGrammars | None = None,
        disk: DiskTier | None = None,
        kv_bits: int = 0,
        quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
        most_drafted: int = 0,
        sum_across_ranks: Callable[[list[int]], list[int]] = list,
    ):
        self._grammars = grammars
        self._sum_across_ranks = sum_across_ranks  # the group's all_sum (a group of one: as is)
        self.prefilled_tokens = 0  # prompt tokens run through the model, for the engine's info
        self._missed: list[list[int]] = []  # [uid, entry] since the last drain
        self.checksum = 0
        # every rank decides alike: same model, same caches
        self.keep_prefixes = keep_prefixes and reusable(make_prompt_cache(model))
        self.prefixes = PrefixStore(disk if self.keep_prefixes else None)
        self._kept: list[list[int]] = []  # [entry, tokens held, bytes] since the last drain
        keep = self._keep if self.keep_prefixes else None
        # speculation decides alike on every rank: the same tokens drafted from, the same
        # tokens drawn, so the same verifying passes meet in the same all_sums
        self._batch = DecodeBatch(
            model, max_batch, prefill_chunk, keep, kv_bits, quantized_kv_start, most_drafted
        )

    def __len__(self) -> int:
        return len(self._batch)

    def apply(self, command: Command) -> list[tuple[Any, ...]]:
        """Keep, remove, insert, then (if asked) step once: the (uid, token) pairs sampled, each
        followed by (logprob, [[id, logprob], ...]) when the sequence asked for logprobs."""
        for uid, entry in command.keeps:  # first: a sequence removed now still has its prompt
            self._keep_prompt(uid, entry)
        self._batch.remove(command.removes)
        usable = self._usable_entries(command.inserts)
        first_tokens: list[tuple[Any, ...]] = []  # sampled at insert
        for insert in command.inserts:
            first = self._insert(insert, insert.entry in usable)
            if first is not None:  # the rest and the first token in one pass, on every rank
                first_tokens.append(self._reported(first))
        self.prefixes.drop(command.evicts)  # after the inserts: one may start from an evictee
        self.prefixes.spill(command.spills)
        if first_tokens:  # reported before the batch advances, as the single engine does
            return first_tokens
        if not command.advance or not len(self._batch):
            return []
        return [self._reported(output) for output in self._batch.step()]

    def _insert(self, insert: Insert, from_entry: bool) -> StepOutput | None:
        """Insert one sequence, from its entry's first `cached` tokens when `from_entry`."""
        request = insert.request
        grammar = None
        if request.grammar is not None:
            if self._grammars is None:
                raise EngineError("a sequence with a grammar reached a batch without grammars")
            grammar = self._grammars.processor(request.grammar)
        sampler = make_request_sampler(request)
        processors = make_request_processors(request, grammar)
        caches, prefix = None, []
        if from_entry:
            try:
                caches, prefix = self.prefixes.take_prefix(insert.entry, insert.cached)
            except DiskUnreadable as error:  # this rank alone: the ranks would diverge
                raise EngineError(f"prefix-cache disk tier: {error}") from error
        elif insert.entry >= 0:
            self._missed.append([insert.uid, insert.entry])
        rest = request.prompt_tokens[len(prefix) :]
        self.prefilled_tokens += len(rest)
        return self._batch.insert(
            insert.uid, rest, sampler, processors, request.logprobs, caches, prefix,
            speculate=grammar is None,  # a grammar's matcher advances one token at a time
        )  # fmt: skip

    def _usable_entries(self, inserts: tuple[Insert, ...]) -> set[int]:
        """The entries these inserts start from that every rank holds and can read now: one
        any rank lacks (a failed disk write, a torn or deleted file) is a miss on all of
        them, so the ranks never diverge. One `all_sum` when any insert names an entry."""
        entries = sorted({insert.entry for insert in inserts if insert.entry >= 0})
        if not entries:
            return set()
        lacking = self._sum_across_ranks([0 if self._readable(entry) else 1 for entry in entries])
        return {entry for entry, count in zip(entries, lacking, strict=True) if count == 0}

    def _readable(self, entry: int) -> bool:
        """Whether this rank holds `entry`: in memory, or on disk and read back (checked) now."""
        try:
            self.prefixes.load(entry)
        except DiskUnreadable as error:
            log.warning("prefix cache: %s; every rank prefills the whole prompt", error)
            return False
        return True

    def _reported(self, output: StepOutput) -> tuple[Any, ...]:
        """(uid, token), then (logprob, [[id, logprob], ...]) when the sequence asked."""
        self.checksum = update_checksum(update_checksum(self.checksum, output.uid), output.token)
        if output.logprob is None:
            return (output.uid, output.token)
        best = [list(pair) for pair in output.top_logprobs]
        return (output.uid, output.token, output.logprob, best)

    def drain_kept(self) -> list[list[int]]:
        """[entry, tokens held, bytes on this rank] of each entry kept since the last call."""
        kept, self._kept = self._kept, []
        return kept

    def drain_missed(self) -> list[list[int]]:
        """[uid, entry] of each insert since the last call that prefilled its whole prompt
        because a rank could not use its entry."""
        missed, self._missed = self._missed, []
        return missed

    def _keep(self, entry: int, caches: list[Any], tokens: list[int]) -> None:
        if self.keep_prefixes and tokens:
            nbytes = self.prefixes.put(entry, caches, tokens)
            self._kept.append([entry, len(tokens), nbytes])

    def _keep_prompt(self, uid: int, entry: int) -> None:
        """Keep a running sequence's prompt KV (once prefilled) as `entry`; nothing when it
        is not in the batch."""
        if uid in self._batch and (found := self._batch.prompt_cache(uid)) is not None:
            self._keep(entry, *found)

    def speculation(self) -> dict[str, int] | None:
        """Tokens drafted and accepted so far (engines/speculation/lane.py); None when off."""
        counts = self._batch.speculation()
        return None if counts is None else asdict(counts)

    def close(self) -> None:
        self.prefixes.close()
        self._batch.close()
