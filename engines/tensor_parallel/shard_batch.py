"""ShardBatch: one rank's copy of the batch, advanced by the commands every rank receives."""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from engines.core.engine import DEFAULT_PREFILL_CHUNK, StepOutput
from engines.decoding.decode_batch import DecodeBatch
from engines.decoding.sampling import make_request_processors, make_request_sampler
from engines.prefix_cache.disk_tier import DiskTier, DiskUnreadable
from engines.prefix_cache.store import PrefixStore, reusable
from engines.tensor_parallel.lockstep import Command, update_checksum
from engines.tensor_parallel.rank_grammar import RankGrammars
from planner.errors import EngineError
from planner.memory import DEFAULT_QUANTIZED_KV_START


class ShardBatch:
    """This rank's DecodeBatch (mlx-lm's BatchGenerator over its shard), driven only by
    lockstep commands.

    Every rank applies the same removes and inserts in the same order and steps the same
    number of times, so the generators assign the same uids, run the same sharded forward
    passes (whose `all_sum`s meet across ranks), and sample the same tokens.

    With `keep_prefixes`, every sequence that ends leaves its KV shard in this rank's prefix
    store under its uid; rank 0's engine indexes it (from `drain_kept`) and names the
    entries to start from and to drop in later commands.

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
    ):
        self._grammars = grammars
        self.checksum = 0
        # every rank decides alike: same model, same caches
        self.keep_prefixes = keep_prefixes and reusable(make_prompt_cache(model))
        self.prefixes = PrefixStore(disk if self.keep_prefixes else None)
        self._kept: list[list[int]] = []  # [uid, tokens held, bytes] since the last drain
        keep = self._keep if self.keep_prefixes else None
        self._batch = DecodeBatch(
            model, max_batch, prefill_chunk, keep, kv_bits, quantized_kv_start
        )

    def __len__(self) -> int:
        return len(self._batch)

    def apply(self, command: Command) -> list[tuple[Any, ...]]:
        """Remove, insert, then (if asked) step once: the (uid, token) pairs sampled, each
        followed by (logprob, [[id, logprob], ...]) when the sequence asked for logprobs."""
        self._batch.remove(command.removes)
        first_tokens: list[tuple[Any, ...]] = []  # sampled at insert
        for insert in command.inserts:
            request = insert.request
            grammar = None
            if request.grammar is not None:
                if self._grammars is None:
                    raise EngineError("a sequence with a grammar reached a batch without grammars")
                grammar = self._grammars.processor(request.grammar)
            sampler = make_request_sampler(request)
            processors = make_request_processors(request, grammar)
            caches, prefix = None, []
            if insert.entry >= 0:
                try:
                    caches, prefix = self.prefixes.take_prefix(insert.entry, insert.cached)
                except DiskUnreadable as error:  # this rank alone: the ranks would diverge
                    raise EngineError(f"prefix-cache disk tier: {error}") from error
            first = self._batch.insert(
                insert.uid, request.prompt_tokens, sampler, processors,
                request.logprobs, caches, prefix,
            )  # fmt: skip
            if first is not None:  # the rest and the first token in one pass, on every rank
                first_tokens.append(self._reported(first))
        self.prefixes.drop(command.evicts)  # after the inserts: one may start from an evictee
        self.prefixes.spill(command.spills)
        if first_tokens:  # reported before the batch advances, as the single engine does
            return first_tokens
        if not command.advance or not len(self._batch):
            return []
        return [self._reported(output) for output in self._batch.step()]

    def _reported(self, output: StepOutput) -> tuple[Any, ...]:
        """(uid, token), then (logprob, [[id, logprob], ...]) when the sequence asked."""
        self.checksum = update_checksum(update_checksum(self.checksum, output.uid), output.token)
        if output.logprob is None:
            return (output.uid, output.token)
        best = [list(pair) for pair in output.top_logprobs]
        return (output.uid, output.token, output.logprob, best)

    def drain_kept(self) -> list[list[int]]:
        """[uid, tokens held, bytes on this rank] of each entry kept since the last call."""
        kept, self._kept = self._kept, []
        return kept

    def _keep(self, uid: int, caches: list[Any], tokens: list[int]) -> None:
        if self.keep_prefixes and tokens:
            nbytes = self.prefixes.put(uid, caches, tokens)
            self._kept.append([uid, len(tokens), nbytes])

    def close(self) -> None:
        self.prefixes.close()
        self._batch.close()
