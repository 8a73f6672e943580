"""SingleEngine: the whole model on this machine, continuously batched by mlx-lm."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
from mlx_lm import load as load_model_and_tokenizer
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from engines.core.engine import (
    DEFAULT_MAX_BATCH,
    DEFAULT_PREFILL_CHUNK,
    Engine,
    EngineInfo,
    GenerationRequest,
    StepOutput,
)
from engines.decoding.grammar import GrammarCompiler
from engines.decoding.sampling import UnseededSamplers, make_request_processors, token_logprobs
from engines.model.load_progress import evaluate_by_layer
from engines.model.precision import upcast_on_cpu
from engines.observability.process_memory import parameter_bytes
from engines.prefix_cache.cached_prefill import first_token_from_cache
from engines.prefix_cache.index import PrefixIndex
from engines.prefix_cache.store import NOT_REUSABLE, PrefixStore, reusable
from planner.errors import EngineError

log = logging.getLogger(__name__)



class SingleEngine(Engine):
    """One process, one model: mlx-lm's BatchGenerator and its batched KV caches.

    Every `step()` is one `BatchGenerator.next()`: a decode step for the running sequences,
    then one prefill chunk for the newcomers, so a long prompt delays the others by one
    chunk per step instead of its whole prefill.
    """

    features = frozenset({"penalties", "logprobs", "grammar"})

    def __init__(
        self,
        model_path: Path,
        max_batch: int = DEFAULT_MAX_BATCH,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        upcast: bool = False,
        prefix_cache_bytes: int = 0,
    ) -> None:
        self.model_path = Path(model_path)
        # the prefix cache: which token prefixes are kept (index) and their KV (store)
        self.prefix_index = PrefixIndex(prefix_cache_bytes)
        self._prefix_store = PrefixStore()
        self.upcast = upcast  # half-precision weights to float32 on the CPU
        self.compute_dtype = ""
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.model = None
        self._weight_bytes = 0
        self.tokenizer = None
        self._generator: BatchGenerator | None = None
        self._to_generator: dict[int, int] = {}  # our uid -> the generator's uid
        self._from_generator: dict[int, int] = {}
        self._logprobs: dict[int, int] = {}  # uid -> top k, for sequences that asked
        self._first_tokens: list[StepOutput] = []  # sampled at insert, reported by the next step
        self._grammars: GrammarCompiler | None = None
        self._samplers = UnseededSamplers()  # a batch without seeds samples in one call

    def load(self) -> None:
        try:
            # lazily, then layer by layer: a progress bar can count the layers loaded
            self.model, self.tokenizer = load_model_and_tokenizer(str(self.model_path), lazy=True)
            evaluate_by_layer(self.model)
        except (OSError, ValueError, RuntimeError) as error:
            raise EngineError(f"cannot load model {self.model_path}: {error}") from error
        self.compute_dtype = upcast_on_cpu(self.model, self.upcast)
        self._weight_bytes = parameter_bytes(self.model)
        if not reusable(make_prompt_cache(self.model)):
            self.prefix_index.turn_off(NOT_REUSABLE)
        vocab_size = getattr(getattr(self.model, "args", None), "vocab_size", 0)
        self._grammars = GrammarCompiler(self.tokenizer, max(vocab_size, len(self.tokenizer)))
        self._generator = BatchGenerator(
            self.model,
            completion_batch_size=self.max_batch,
            prefill_batch_size=self.max_batch,
            prefill_step_size=self.prefill_chunk,
        )
        log.info("single engine loaded %s (batch of up to %d)", self.model_path, self.max_batch)

    def insert(self, uid: int, request: GenerationRequest) -> int:
        if self._generator is None:
            raise EngineError("single engine used before load()")
        if not request.prompt_tokens:
            raise EngineError("the prompt is empty: a request needs at least one token")
        sampler = self._samplers.for_request(request)
        processors = make_request_processors(
            request.repetition_penalty, request.presence_penalty, request.frequency_penalty
        )
        if request.grammar is not None:  # last: penalties must not lift the grammar's mask
            processors.append(self._grammars.processor(request.grammar))
        prompt = list(request.prompt_tokens)
        hit = self.prefix_index.lookup(prompt)
        caches, prefix, max_tokens = None, [], request.max_tokens
        if hit is not None:
            caches, prefix = self._prefix_store.take_prefix(hit.entry_id, hit.tokens)
            if len(prompt) - hit.tokens <= self.prefill_chunk:
                # the rest and the first token in one forward pass (prefix_cache/cached_prefill.py)
                with mx.stream(self._generator.stream):
                    token, logprobs = first_token_from_cache(
                        self.model, caches, prompt[hit.tokens :], prompt, sampler, processors
                    )
                self._first_tokens.append(self._output(uid, token, logprobs, request.logprobs))
                prompt, prefix, max_tokens = prompt + [token], prompt, max(max_tokens - 1, 1)
        (generator_uid,) = self._generator.insert(
            [prompt[len(prefix) :]],
            max_tokens=[max_tokens],
            caches=[caches],
            all_tokens=[prefix],
            samplers=[sampler],
            logits_processors=[processors],
        )
        self._to_generator[uid] = generator_uid
        self._from_generator[generator_uid] = uid
        if request.logprobs is not None:
            self._logprobs[uid] = request.logprobs
        return hit.tokens if hit is not None else 0

    def remove(self, uids: Sequence[int]) -> None:
        self._first_tokens = [output for output in self._first_tokens if output.uid not in uids]
        gone = [self._to_generator.pop(uid) for uid in uids if uid in self._to_generator]
        for generator_uid in gone:
            self._logprobs.pop(self._from_generator[generator_uid], None)
        if gone and self._generator is not None:
            kept = self._generator.remove(gone, return_prompt_caches=self.prefix_index.enabled)
            for generator_uid, (caches, tokens) in kept.items():
                self._keep_prefix(self._from_generator[generator_uid], caches, tokens)
        for generator_uid in gone:
            del self._from_generator[generator_uid]

    def evict_prefix_cache(self, keep_fraction: float) -> int:
        before = self.prefix_index.nbytes
        self._prefix_store.drop(self.prefix_index.evict(keep_fraction))
        return before - self.prefix_index.nbytes

    def _keep_prefix(self, uid: int, caches: list, tokens: list[int]) -> None:
        """A finished sequence's prompt + answer becomes a prefix-cache entry named by its uid."""
        if not self.prefix_index.enabled or not tokens:
            return
        nbytes = self._prefix_store.put(uid, caches, tokens)
        self._prefix_store.drop(self.prefix_index.add(uid, tokens, nbytes))

    def step(self) -> list[StepOutput]:
        if self._generator is None:
            raise EngineError("single engine used before load()")
        if self._first_tokens:  # sampled at insert: report them before advancing the batch
            outputs, self._first_tokens = self._first_tokens, []
            return outputs
        outputs = []
        _, responses = self._generator.next()
        for response in responses:
            uid = self._from_generator.get(response.uid)
            if uid is None:
                continue
            top = self._logprobs.get(uid)
            outputs.append(self._output(uid, response.token, response.logprobs, top))
            if response.finish_reason is not None:  # the generator already dropped it
                del self._from_generator[response.uid]
                del self._to_generator[uid]
                self._logprobs.pop(uid, None)
                self._keep_prefix(uid, response.prompt_cache, response.all_tokens)
        return outputs

    @staticmethod
    def _output(uid: int, token: int, logprobs: mx.array, top: int | None) -> StepOutput:
        if top is None:
            return StepOutput(uid, token)
        chosen, best = token_logprobs(logprobs, token, top)
        return StepOutput(uid, token, None, chosen, best)

    def memory_held(self) -> dict[str, int]:
        cached = self.prefix_index.snapshot()["bytes"]
        return {"weights": self._weight_bytes, "prefix_cache": cached}

    def info(self) -> EngineInfo:
        detail = {
            "model_path": str(self.model_path),
            "max_batch": self.max_batch,
            "prefill_chunk": self.prefill_chunk,
            "compute_dtype": self.compute_dtype,
            "prefix_cache": self.prefix_index.snapshot(),
        }
        return EngineInfo(strategy="single", world_size=1, detail=detail)

    def close(self) -> None:
        if self._generator is not None:
            self._generator.close()
        self._generator = None
        self._prefix_store.clear()
        self.prefix_index.clear()
        self.model = None
        self._weight_bytes = 0
        mx.clear_cache()
