"""DecodeBatch: mlx-lm's BatchGenerator under the runner's uids, shared by the single engine
and every tensor-parallel rank (each over its own model or shard).

It inserts a sequence (from a prefix-cache entry when it has one: then, into an empty batch
and when the rest of the prompt fits one prefill chunk, the rest and the first token in one
forward pass), removes sequences, steps the batch, and hands every removed sequence's caches
to `keep` (the owner's prefix cache) so nothing else needs to know the generator's own uids.

It never ends a sequence itself: the runner's ActiveSequence alone decides that a sequence is done
(EOS, length, stop text, cancel, deadline) and removes it, so the generator is given a length it
never reaches.

With speculation on (`most_drafted` > 0), a sequence decoding alone leaves the generator for a
SpeculativeLane, which checks drafted tokens several at a time; it goes back (its caches and
its next token, as a prefix-cache hit would) as soon as another sequence arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from engines.core.engine import StepOutput
from engines.decoding.sampling import Processor, Sampler, sampled
from engines.model.kv_quantization import kv_quantization, quantizes_inside
from engines.prefix_cache.cached_prefill import first_token_from_cache
from engines.speculation.lane import (
    DrafterFactory,
    SpeculationCounts,
    SpeculativeLane,
    speculable,
)
from engines.speculation.prompt_lookup import PromptLookup
from planner.memory import DEFAULT_QUANTIZED_KV_START

Keep = Callable[[int, list[Any], list[int]], None]  # (uid, caches, the tokens they hold)

NEVER_ENDS = 1 << 62  # the generator's max_tokens: the runner ends every sequence


class DecodeBatch:
    """The sequences of one batch; `keep=None` keeps no caches of finished sequences;
    `kv_bits` (8 or 4) quantizes every sequence's KV cache once it holds
    `quantized_kv_start` tokens (as mlx-lm's generate_step), 0 keeps it as computed;
    `most_drafted` tokens at most are drafted per step of a sequence alone, 0: none (by
    prompt lookup, or the `drafter` given)."""

    def __init__(
        self,
        model: Any,
        max_batch: int,
        prefill_chunk: int,
        keep: Keep | None = None,
        kv_bits: int = 0,
        quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
        most_drafted: int = 0,
        drafter: DrafterFactory = PromptLookup,
    ) -> None:
        self.model = model
        self.prefill_chunk = prefill_chunk
        self._keep = keep
        self.kv_bits = kv_bits
        # refuses a model it cannot quantize, now
        self.kv = kv_quantization(model, kv_bits, quantized_kv_start) if kv_bits else None
        self.generator = BatchGenerator(
            model,
            completion_batch_size=max_batch,
            prefill_batch_size=max_batch,
            prefill_step_size=prefill_chunk,
        )
        self._to_generator: dict[int, int] = {}  # our uid -> the generator's uid
        self._from_generator: dict[int, int] = {}
        self._logprobs: dict[int, int] = {}  # uid -> top k, for sequences that asked
        # speculation (a quantized cache is not trimmed here): who may, and who decodes
        self.lane = (
            SpeculativeLane(model, self.generator.stream, most_drafted, drafter)
            if most_drafted > 0 and self.kv is None
            else None
        )
        self._speculable: dict[int, tuple[Sampler, list[Processor]]] = {}
        self._decoding: set[int] = set()  # uids the generator has produced a token for

    def __len__(self) -> int:
        return len(self._to_generator) + (self._lane_uid() is not None)

    def __contains__(self, uid: int) -> bool:
        return uid in self._to_generator or uid == self._lane_uid()

    def _lane_uid(self) -> int | None:
        return None if self.lane is None or self.lane.sequence is None else self.lane.sequence.uid

    def insert(
        self,
        uid: int,
        rest: Sequence[int],
        sampler: Sampler,
        processors: list[Processor],
        top_logprobs: int | None = None,
        caches: list[Any] | None = None,
        prefix: Sequence[int] = (),
        speculate: bool = True,
    ) -> StepOutput | None:
        """Add a sequence: `rest` is its prompt after the `prefix` its `caches` hold (all of it
        without caches). Returns its first token when it was computed here, in one pass.
        `speculate=False`: never drafted for (a stateful processor, say a grammar's)."""
        self._leave_lane()  # it is not alone any more
        first = None
        rest, prefix = list(rest), list(prefix)
        if caches is not None and self.kv is not None:  # an entry: this engine's kind of cache
            caches = [self.kv.adopt(cache) for cache in caches]
        if (
            caches is not None
            # a hit joining a running batch is computed in the batch's next step with the
            # others': a pass of its own would stall the whole batch (64 hits at once, each
            # with its own pass, took 30% of the engine core at 64 streams)
            and len(self) == 0
            and len(rest) <= self.prefill_chunk
            # mlx-lm quantizes after the rest but its last token: the generator does the same
            and not quantizes_inside(caches, len(rest))
        ):
            with mx.stream(self.generator.stream):
                token, logprobs = first_token_from_cache(
                    self.model, caches, rest, prefix + rest, sampler, processors
                )
            first = sampled(uid, token, logprobs, top_logprobs)
            rest, prefix = [token], prefix + rest  # the generator goes on from the first token
        if caches is None and self.kv is not None:  # else the generator makes unquantized ones
            caches = self.kv.make_caches()
        self._to_generator_insert(uid, rest, caches, prefix, sampler, processors)
        if top_logprobs is not None:
            self._logprobs[uid] = top_logprobs
        if speculate and self.lane is not None:
            self._speculable[uid] = (sampler, processors)
        return first

    def _to_generator_insert(
        self,
        uid: int,
        rest: list[int],
        caches: list[Any] | None,
        prefix: list[int],
        sampler: Sampler,
        processors: list[Processor],
    ) -> None:
        (generator_uid,) = self.generator.insert(
            [rest],
            max_tokens=[NEVER_ENDS],
            caches=[caches],
            all_tokens=[prefix],
            samplers=[sampler],
            logits_processors=[processors],
        )
        self._to_generator[uid] = generator_uid
        self._from_generator[generator_uid] = uid

    def _enter_lane(self) -> None:
        """The one sequence decoding in the generator, when it may speculate, moves to the lane."""
        if len(self._to_generator) != 1 or self.lane.sequence is not None:
            return
        ((uid, generator_uid),) = self._to_generator.items()
        if uid not in self._decoding or uid not in self._speculable:
            return
        caches, tokens = self.generator.extract_cache([generator_uid])[generator_uid]
        if not speculable(caches):
            del self._speculable[uid]  # a recurrent layer, or a full sliding window: never
            return
        self.generator.remove([generator_uid])
        del self._to_generator[uid], self._from_generator[generator_uid]
        sampler, processors = self._speculable[uid]
        self.lane.take(uid, caches, tokens, sampler, processors, self._logprobs.get(uid))

    def _leave_lane(self) -> None:
        """The lane's sequence, if any, goes on in the generator from its next token."""
        if self.lane is None or self.lane.sequence is None:
            return
        sequence = self.lane.give_back()
        self._decoding.discard(sequence.uid)
        self._to_generator_insert(
            sequence.uid, [sequence.next_token], sequence.caches, sequence.tokens,
            sequence.sampler, sequence.processors,
        )  # fmt: skip

    def remove(self, uids: Sequence[int]) -> None:
        """Drop sequences (unknown uids are ignored); their caches go to `keep`."""
        for uid in uids:
            self._speculable.pop(uid, None)
            self._decoding.discard(uid)
        if (lane_uid := self._lane_uid()) is not None and lane_uid in uids:
            sequence = self.lane.give_back()
            self._logprobs.pop(lane_uid, None)
            if self._keep is not None:
                self._keep(lane_uid, sequence.caches, sequence.tokens)
        gone = [self._to_generator.pop(uid) for uid in uids if uid in self._to_generator]
        if not gone:
            return
        kept = self.generator.remove(gone, return_prompt_caches=self._keep is not None)
        for generator_uid in gone:
            self._logprobs.pop(self._from_generator[generator_uid], None)
        for generator_uid, (caches, tokens) in (kept or {}).items():
            self._keep(self._from_generator[generator_uid], caches, tokens)
        for generator_uid in gone:
            del self._from_generator[generator_uid]

    def prompt_cache(self, uid: int) -> tuple[list[Any], list[int]] | None:
        """A running sequence's caches and the tokens they hold (its prompt, once prefilled),
        copied out of the batch; None when it is not in the batch."""
        generator_uid = self._to_generator.get(uid)
        if generator_uid is None:
            return None
        found = self.generator.extract_cache([generator_uid]).get(generator_uid)
        if not found or not found[0]:
            return None
        caches, tokens = found
        length = caches[0].offset
        return (caches, list(tokens)[:length]) if 0 < length <= len(tokens) else None

    def step(self) -> list[StepOutput]:
        """One step of the whole batch: a token for every sequence the generator produced, or
        one or more for the sequence in the lane."""
        if self.lane is not None:
            self._enter_lane()
            if self.lane.sequence is not None:
                return self.lane.step()
        _, responses = self.generator.next()
        outputs = []
        for response in responses:
            uid = self._from_generator.get(response.uid)
            if uid is None:
                continue
            if response.finish_reason is not None:  # only NEVER_ENDS tokens later
                raise RuntimeError(f"the batch generator ended sequence {uid} on its own")
            outputs.append(sampled(uid, response.token, response.logprobs, self._logprobs.get(uid)))
            self._decoding.add(uid)
        return outputs

    def speculation(self) -> SpeculationCounts | None:
        """Tokens drafted and accepted so far; None with speculation off."""
        return None if self.lane is None else self.lane.counts

    def close(self) -> None:
        self.generator.close()
