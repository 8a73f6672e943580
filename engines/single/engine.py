"""SingleEngine: the whole model on this machine, continuously batched by mlx-lm."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import mlx.core as mx
from mlx_lm import load as load_model_and_tokenizer
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from engines.core.engine import Engine, EngineInfo, StepOutput
from engines.core.engine_options import DEFAULT_OPTIONS, EngineOptions
from engines.core.request import GenerationRequest
from engines.decoding.decode_batch import DecodeBatch
from engines.decoding.grammar import GrammarCompiler
from engines.decoding.sampling import UnseededSamplers, make_request_processors
from engines.model.gemm_layout import lay_out
from engines.model.packed_quantized import pack, runs_on_kernel
from engines.model.precision import upcast_on_cpu
from engines.observability.load_progress import evaluate_by_layer
from engines.observability.process_memory import parameter_bytes
from engines.prefix_cache.books import PrefixBooks
from engines.prefix_cache.disk_tier import DiskTier, DiskUnreadable, tier_root
from engines.prefix_cache.index import PrefixIndex
from engines.prefix_cache.store import NOT_REUSABLE, PrefixStore, reusable
from engines.speculation.draft_model import DraftModelDrafter, check_draft_model
from engines.speculation.lane import DrafterFactory
from engines.speculation.prompt_lookup import PromptLookup, TimedPromptLookup
from errors import EngineError

log = logging.getLogger(__name__)

DISK_MARGIN = 256 << 20  # free disk the prefix cache's disk tier always leaves
TOP_PRIVATE_ENTRY_ID = -1  # entries no runner uid names (restored, shared prompts) count down


class SingleEngine(Engine):
    """One process, one model: mlx-lm's BatchGenerator and its batched KV caches.

    Every `step()` is one `BatchGenerator.next()`: a decode step for the running sequences,
    then one prefill chunk for the newcomers, so a long prompt delays the others by one
    chunk per step instead of its whole prefill.
    """

    features = frozenset({"penalties", "logprobs", "grammar"})

    def __init__(self, model_path: Path, options: EngineOptions = DEFAULT_OPTIONS) -> None:
        self.model_path = Path(model_path)
        self.options = options
        path = options.draft_model_path
        self.draft_model_path = Path(path) if path else None
        self.draft_model = None
        # the prefix cache: what is kept and who waits for what (books) and the KV (store),
        # in memory and, with a disk budget and a directory, on disk
        disk = self._open_disk_tier(options)
        disk_bytes = options.prefix_cache_disk_bytes if disk is not None else 0
        index = PrefixIndex(options.prefix_cache_bytes, disk_bytes=disk_bytes)
        self.books = PrefixBooks(index, TOP_PRIVATE_ENTRY_ID)
        self.prefix_store = PrefixStore(disk if index.disk_max_bytes else None)
        self.compute_dtype = ""
        self.model = None
        self._weight_bytes = 0
        self.tokenizer = None
        self._batch: DecodeBatch | None = None
        self._first_tokens: list[StepOutput] = []  # sampled at insert, reported by the next step
        self._grammars: GrammarCompiler | None = None
        self._samplers = UnseededSamplers()  # a batch without seeds samples in one call

    def _open_disk_tier(self, options: EngineOptions) -> DiskTier | None:
        """The disk tier under this machine's prefix_cache_dir, in a folder of this model's
        and KV quantization's own; None without a budget or a directory."""
        if not options.prefix_cache_disk_bytes or options.prefix_cache_dir is None:
            return None
        kv_bits = options.kv_bits
        share = f"single-kv{kv_bits}" if kv_bits else "single"
        root = tier_root(Path(options.prefix_cache_dir), self.model_path, share)
        # entries of another KV quantization are another cache's: never read as this one's
        quantized = f"|kv{kv_bits}from{options.quantized_kv_start}" if kv_bits else ""
        return DiskTier(root, identity=str(root) + quantized)

    @property
    def prefix_index(self) -> PrefixIndex:
        return self.books.index

    def load(self) -> None:
        try:
            # lazily, then layer by layer: a progress bar can count the layers loaded
            self.model, self.tokenizer = load_model_and_tokenizer(str(self.model_path), lazy=True)
            evaluate_by_layer(self.model)
        except (OSError, ValueError, RuntimeError) as error:
            raise EngineError(f"cannot load model {self.model_path}: {error}") from error
        self.compute_dtype = upcast_on_cpu(self.model, self.options.upcast)
        (self.model,) = pack(*lay_out(self.model))  # float32 layers, then quantized ones
        self._weight_bytes = parameter_bytes(self.model)
        if not reusable(make_prompt_cache(self.model)):
            self.prefix_index.turn_off(NOT_REUSABLE)
        elif self.prefix_store.disk is not None:
            self._restore_from_disk(self.prefix_store.disk)
        vocab_size = getattr(getattr(self.model, "args", None), "vocab_size", 0)
        self._grammars = GrammarCompiler(self.tokenizer, max(vocab_size, len(self.tokenizer)))
        if getattr(self.tokenizer, "has_tool_calling", False):
            self._grammars.prepare()  # every request with tools has a grammar (call_guard.py)
        keep = self._keep_prefix if self.prefix_index.enabled else None
        options = self.options
        self._batch = DecodeBatch(
            self.model, options.max_batch, options.prefill_chunk, keep, options.kv_bits,
            options.quantized_kv_start, options.most_drafted, self._load_drafter(),
        )  # fmt: skip
        log.info("single engine loaded %s (batch of up to %d)", self.model_path, options.max_batch)

    def _load_drafter(self) -> DrafterFactory:
        """Prompt lookup (timed where the kernel makes a verifying pass costly), or drafts
        from --draft-model once it is loaded and checked."""
        if self.draft_model_path is None or not self.options.most_drafted:
            return TimedPromptLookup if runs_on_kernel(self.model) else PromptLookup
        try:
            self.draft_model, draft_tokenizer = load_model_and_tokenizer(str(self.draft_model_path))
        except (OSError, ValueError, RuntimeError) as error:
            where = self.draft_model_path
            raise EngineError(f"cannot load draft model {where}: {error}") from error
        check_draft_model(self.draft_model, draft_tokenizer, self.tokenizer)
        upcast_on_cpu(self.draft_model, self.options.upcast)
        self._weight_bytes += parameter_bytes(self.draft_model)
        log.info("drafting from %s", self.draft_model_path)
        return partial(DraftModelDrafter, self.draft_model, generation_stream)

    def insert(self, uid: int, request: GenerationRequest) -> int:
        if self._batch is None:
            raise EngineError("single engine used before load()")
        if not request.prompt_tokens:
            raise EngineError("the prompt is empty: a request needs at least one token")
        if self.books.hold(uid, request):  # a long prefix still being prefilled: wait
            return 0  # its first output will say how many tokens it reused
        return self._insert_now(uid, request)

    def _insert_now(self, uid: int, request: GenerationRequest) -> int:
        sampler = self._samplers.for_request(request)
        grammar = None if request.grammar is None else self._grammars.processor(request.grammar)
        processors = make_request_processors(request, grammar)
        prompt = list(request.prompt_tokens)
        hit = self.books.lookup(prompt)
        caches, prefix = None, []
        if hit is not None:
            try:
                caches, prefix = self.prefix_store.take_prefix(hit.entry_id, hit.tokens)
            except DiskUnreadable as error:  # a torn or corrupt file: a miss, never wrong KV
                log.warning("prefix cache: %s; prefilling the whole prompt", error)
                self.books.discard([hit.entry_id])
                self._carry_out_orders()
                hit = None
        first = self._batch.insert(
            uid, prompt[len(prefix) :], sampler, processors,
            request.logprobs, caches, prefix,
            speculate=request.grammar is None,  # a grammar's matcher advances one token at a time
        )  # fmt: skip
        if first is not None:  # reported by the next step, before the batch advances
            self._first_tokens.append(first)
        else:
            self.books.prefilling(uid, tuple(request.prompt_tokens))
        return hit.tokens if hit is not None else 0

    def remove(self, uids: Sequence[int]) -> None:
        self._first_tokens = [output for output in self._first_tokens if output.uid not in uids]
        self.books.forget(uids)
        if self._batch is not None:
            self._batch.remove(uids)

    def _let_in(self, waiters: list[tuple[int, GenerationRequest]]) -> None:
        """Waiters join the batch; their first output carries the tokens they reused."""
        for uid, request in waiters:
            self.books.report_late(uid, self._insert_now(uid, request))

    def _keep_prompt(self, owner: int) -> None:
        """Keep a just-prefilled prompt's KV as an entry, for the requests waiting for it."""
        if (found := self._batch.prompt_cache(owner)) is not None:
            self._keep_prefix(self.books.take_private_id(), *found)

    def evict_prefix_cache(self, keep_fraction: float) -> int:
        freed = self.books.evict(keep_fraction)
        self._carry_out_orders()
        return freed

    def _keep_prefix(self, uid: int, caches: list, tokens: list[int]) -> None:
        """A finished sequence's prompt + answer becomes a prefix-cache entry named by its uid."""
        if not self.books.worth_keeping(len(tokens)):
            return
        self.books.index_entry(uid, tokens, self.prefix_store.put(uid, caches, tokens))
        self._carry_out_orders()

    def _restore_from_disk(self, disk: DiskTier) -> None:
        """List what a previous run left on disk; ids below zero never meet a runner uid.
        The disk tier's budget is capped by the disk's free space (what is there counts)."""
        stored_entries = disk.open()
        usable = shutil.disk_usage(disk.directory).free + disk.nbytes_on_disk() - DISK_MARGIN
        if self.prefix_index.disk_max_bytes > usable:
            log.warning(
                "prefix cache: %d MB of disk asked for, %d MB usable in %s: using that",
                self.prefix_index.disk_max_bytes >> 20, max(usable, 0) >> 20, disk.directory,
            )  # fmt: skip
            self.prefix_index.disk_max_bytes = max(usable, 0)
        for stored in stored_entries:
            entry = self.books.take_private_id()
            disk.adopt(entry, stored)
            self.books.restore(entry, stored.tokens, stored.nbytes)
            self._carry_out_orders()
        if restored := self.prefix_index.snapshot()["disk_entries"]:
            log.info("prefix cache: %d entries found on disk in %s", restored, disk.directory)

    def _carry_out_orders(self) -> None:
        """The books' orders, on the one store there is: drop entries, then spill to disk."""
        orders = self.books.take_orders()
        self.prefix_store.drop(orders.evict)
        self.prefix_store.spill(orders.spill)

    def step(self) -> list[StepOutput]:
        if self._batch is None:
            raise EngineError("single engine used before load()")
        self._let_in(self.books.released())  # owners gone, or waited long enough
        if self._first_tokens:  # sampled at insert: report them before advancing the batch
            outputs, self._first_tokens = self._first_tokens, []
        else:
            outputs = self._batch.step()
            done = self.books.owners_done(output.uid for output in outputs)
            for owner in done:
                self._keep_prompt(owner)
            if done:
                self._let_in(self.books.released(done))
        if self.books.any_late:
            outputs = [self._with_cached(output) for output in outputs]
        return outputs

    def _with_cached(self, output: StepOutput) -> StepOutput:
        cached = self.books.late_cached(output.uid)
        return output if cached is None else replace(output, cached_tokens=cached)

    def memory_held(self) -> dict[str, int]:
        cached = self.prefix_index.snapshot()["bytes"]
        return {"weights": self._weight_bytes, "prefix_cache": cached}

    def info(self) -> EngineInfo:
        detail = {
            "model_path": str(self.model_path),
            "max_batch": self.options.max_batch,
            "prefill_chunk": self.options.prefill_chunk,
            "compute_dtype": self.compute_dtype,
            "kv_bits": self.options.kv_bits,
            "quantized_kv_start": self.options.quantized_kv_start,
            "prefix_cache": self.books.snapshot(),
        }
        counts = self._batch.speculation() if self._batch is not None else None
        if counts is not None:
            detail["speculation"] = {
                "most_drafted": self.options.most_drafted,
                "drafter": str(self.draft_model_path or "prompt lookup"),
                **asdict(counts),
            }
        return EngineInfo(strategy="single", world_size=1, detail=detail)

    def close(self) -> None:
        if self._batch is not None:
            self._batch.close()
        self._batch = None
        self.books.clear_waiters()
        self.prefix_store.close()
        self.books.clear()
        self.model = None
        self.draft_model = None
        self._weight_bytes = 0
        mx.clear_cache()
