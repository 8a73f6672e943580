"""ShardBatch: one rank's copy of the batch, advanced by the commands every rank receives."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from engines.core.engine import DEFAULT_PREFILL_CHUNK
from engines.decoding.sampling import make_request_processors, make_request_sampler, token_logprobs
from engines.prefix_cache.cached_prefill import first_token_from_cache
from engines.prefix_cache.store import PrefixStore, reusable
from engines.tensor_parallel.lockstep import Command, update_checksum
from engines.tensor_parallel.rank_grammar import RankGrammars
from planner.errors import EngineError


class ShardBatch:
    """mlx-lm's BatchGenerator over this rank's shard, driven only by lockstep commands.

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
    ):
        self._grammars = grammars
        self._model = model
        self._prefill_chunk = prefill_chunk
        self._generator = BatchGenerator(
            model,
            completion_batch_size=max_batch,
            prefill_batch_size=max_batch,
            prefill_step_size=prefill_chunk,
        )
        self._to_generator: dict[int, int] = {}
        self._from_generator: dict[int, int] = {}
        self._logprobs: dict[int, int] = {}  # uid -> top k, for sequences that asked
        self.checksum = 0
        # every rank decides alike: same model, same caches
        self.keep_prefixes = keep_prefixes and reusable(make_prompt_cache(model))
        self.prefixes = PrefixStore()
        self._kept: list[list[int]] = []  # [uid, tokens held, bytes] since the last drain

    def __len__(self) -> int:
        return len(self._to_generator)

    def apply(self, command: Command) -> list[tuple[Any, ...]]:
        """Remove, insert, then (if asked) step once: the (uid, token) pairs sampled, each
        followed by (logprob, [[id, logprob], ...]) when the sequence asked for logprobs."""
        gone = [self._to_generator.pop(uid) for uid in command.removes if uid in self._to_generator]
        for generator_uid in gone:
            self._logprobs.pop(self._from_generator[generator_uid], None)
        if gone:
            kept = self._generator.remove(gone, return_prompt_caches=self.keep_prefixes)
            for generator_uid, (caches, tokens) in kept.items():
                self._keep(self._from_generator[generator_uid], caches, tokens)
        for generator_uid in gone:
            del self._from_generator[generator_uid]
        first_tokens: list[tuple[Any, ...]] = []  # sampled at insert
        for insert in command.inserts:
            sampler = make_request_sampler(insert.temperature, insert.top_p, insert.seed)
            processors = make_request_processors(
                insert.repetition_penalty, insert.presence_penalty, insert.frequency_penalty
            )
            if insert.grammar is not None:  # last: penalties must not lift the grammar's mask
                if self._grammars is None:
                    raise EngineError("a sequence with a grammar reached a batch without grammars")
                processors.append(self._grammars.processor(insert.grammar))
            caches, prefix, prompt, max_tokens = None, [], list(insert.prompt), insert.max_tokens
            if insert.entry >= 0:
                caches, prefix = self.prefixes.take_prefix(insert.entry, insert.cached)
                if len(prompt) <= self._prefill_chunk:
                    # the rest and the first token in one pass, on every rank alike
                    with mx.stream(self._generator.stream):
                        token, logprobs = first_token_from_cache(
                            self._model, caches, prompt, prefix + prompt, sampler, processors
                        )
                    top = insert.logprobs if insert.logprobs >= 0 else None
                    first_tokens.append(self._sampled(insert.uid, token, logprobs, top))
                    prompt, prefix = [token], prefix + prompt
                    max_tokens = max(max_tokens - 1, 1)
            (generator_uid,) = self._generator.insert(
                [prompt],
                max_tokens=[max_tokens],
                caches=[caches],
                all_tokens=[prefix],
                samplers=[sampler],
                logits_processors=[processors],
            )
            self._to_generator[insert.uid] = generator_uid
            self._from_generator[generator_uid] = insert.uid
            if insert.logprobs >= 0:
                self._logprobs[insert.uid] = insert.logprobs
        self.prefixes.drop(command.evicts)  # after the inserts: one may start from an evictee
        if first_tokens:  # reported before the batch advances, as the single engine does
            return first_tokens
        if not command.advance or not self._to_generator:
            return []
        _, responses = self._generator.next()
        tokens = []
        for response in responses:
            uid = self._from_generator.get(response.uid)
            if uid is None:
                continue
            top = self._logprobs.get(uid)
            tokens.append(self._sampled(uid, response.token, response.logprobs, top))
            if response.finish_reason is not None:  # the generator dropped it (max_tokens)
                del self._from_generator[response.uid]
                del self._to_generator[uid]
                self._logprobs.pop(uid, None)
                self._keep(uid, response.prompt_cache, response.all_tokens)
        return tokens

    def _sampled(self, uid: int, token: int, logprobs: Any, top: int | None) -> tuple[Any, ...]:
        """(uid, token), then (logprob, [[id, logprob], ...]) when the sequence asked."""
        self.checksum = update_checksum(update_checksum(self.checksum, uid), token)
        if top is None:
            return (uid, token)
        chosen, best = token_logprobs(logprobs, token, top)
        return (uid, token, chosen, [list(pair) for pair in best])

    def drain_kept(self) -> list[list[int]]:
        """[uid, tokens held, bytes on this rank] of each entry kept since the last call."""
        kept, self._kept = self._kept, []
        return kept

    def _keep(self, uid: int, caches: list[Any], tokens: list[int]) -> None:
        if self.keep_prefixes and tokens:
            nbytes = self.prefixes.put(uid, caches, tokens)
            self._kept.append([uid, len(tokens), nbytes])

    def close(self) -> None:
        self.prefixes.clear()
        self._generator.close()
