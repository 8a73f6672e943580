"""DecodeBatch: mlx-lm's BatchGenerator under the runner's uids, shared by the single engine
and every tensor-parallel rank (each over its own model or shard).

It inserts a sequence (from a prefix-cache entry when it has one: then, when the rest of the
prompt fits one prefill chunk, the rest and the first token in one forward pass), removes
sequences, steps the batch, and hands every removed sequence's caches to `keep` (the owner's
prefix cache) so nothing else needs to know the generator's own uids.

It never ends a sequence itself: the runner's ActiveSequence alone decides that a sequence is done
(EOS, length, stop text, cancel, deadline) and removes it, so the generator is given a length it
never reaches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from engines.core.engine import StepOutput
from engines.decoding.sampling import Processor, Sampler, token_logprobs
from engines.model.kv_quantization import kv_quantization, quantizes_inside
from engines.prefix_cache.cached_prefill import first_token_from_cache
from planner.memory import DEFAULT_QUANTIZED_KV_START

Keep = Callable[[int, list[Any], list[int]], None]  # (uid, caches, the tokens they hold)

NEVER_ENDS = 1 << 62  # the generator's max_tokens: the runner ends every sequence


class DecodeBatch:
    """The sequences of one batch; `keep=None` keeps no caches of finished sequences;
    `kv_bits` (8 or 4) quantizes every sequence's KV cache once it holds
    `quantized_kv_start` tokens (as mlx-lm's generate_step), 0 keeps it as computed."""

    def __init__(
        self,
        model: Any,
        max_batch: int,
        prefill_chunk: int,
        keep: Keep | None = None,
        kv_bits: int = 0,
        quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
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

    def __len__(self) -> int:
        return len(self._to_generator)

    def __contains__(self, uid: int) -> bool:
        return uid in self._to_generator

    def insert(
        self,
        uid: int,
        rest: Sequence[int],
        sampler: Sampler,
        processors: list[Processor],
        top_logprobs: int | None = None,
        caches: list[Any] | None = None,
        prefix: Sequence[int] = (),
    ) -> StepOutput | None:
        """Add a sequence: `rest` is its prompt after the `prefix` its `caches` hold (all of it
        without caches). Returns its first token when it was computed here, in one pass."""
        first = None
        rest, prefix = list(rest), list(prefix)
        if caches is not None and self.kv is not None:  # an entry: this engine's kind of cache
            caches = [self.kv.adopt(cache) for cache in caches]
        if (
            caches is not None
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
        if top_logprobs is not None:
            self._logprobs[uid] = top_logprobs
        return first

    def remove(self, uids: Sequence[int]) -> None:
        """Drop sequences (unknown uids are ignored); their caches go to `keep`."""
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
        found = self.generator.extract_cache([generator_uid]).get(generator_uid)
        if not found or not found[0]:
            return None
        caches, tokens = found
        length = caches[0].offset
        return (caches, list(tokens)[:length]) if 0 < length <= len(tokens) else None

    def step(self) -> list[StepOutput]:
        """One step of the whole batch: a token for every sequence the generator produced."""
        _, responses = self.generator.next()
        outputs = []
        for response in responses:
            uid = self._from_generator.get(response.uid)
            if uid is None:
                continue
            if response.finish_reason is not None:  # only NEVER_ENDS tokens later
                raise RuntimeError(f"the batch generator ended sequence {uid} on its own")
            outputs.append(sampled(uid, response.token, response.logprobs, self._logprobs.get(uid)))
        return outputs

    def close(self) -> None:
        self.generator.close()


def sampled(uid: int, token: int, logprobs: mx.array, top: int | None) -> StepOutput:
    """The step output of a sampled token, with its logprob and the top `top` when asked."""
    if top is None:
        return StepOutput(uid, token)
    chosen, best = token_logprobs(logprobs, token, top)
    return StepOutput(uid, token, None, chosen, best)
