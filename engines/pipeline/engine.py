"""EncryptedPipelineEngine: stage 0 here, sealed micro-batches in flight down a chain of stages."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from discovery.secure_channel import SecureChannel
from engines.core.engine import Engine, EngineInfo, StepOutput
from engines.core.engine_options import DEFAULT_OPTIONS, EngineOptions
from engines.core.request import GenerationRequest
from engines.decoding.grammar import GrammarCompiler
from engines.model.info import inspect_model
from engines.model.tokenizer_loading import load_serving_tokenizer
from engines.observability.process_memory import parameter_bytes
from engines.observability.step_timing import StepTimes
from engines.pipeline import wire
from engines.pipeline.admission import sampling_of, wire_refusal
from engines.pipeline.batches import StageBatches
from engines.pipeline.chain import Chain
from engines.pipeline.chain_disk import ChainDiskTier, chain_disk_tier
from engines.pipeline.chain_upkeep import ChainUpkeep
from engines.pipeline.disk_relisting import DiskRelisting
from engines.pipeline.frame_clock import FrameClock
from engines.pipeline.prefix_keeping import TOP_PRIVATE_ENTRY_ID, PrefixKeeping
from engines.pipeline.schedule import MicroBatchSchedule, Planned
from engines.pipeline.shared_prompts import SharedPrompts
from engines.pipeline.speculation import PipelineSpeculation
from engines.pipeline.stage_address import StageAddress
from engines.pipeline.stage_model import StageModel
from engines.pipeline.wire import Kind, Row
from engines.prefix_cache.books import PrefixBooks
from engines.prefix_cache.index import PrefixIndex
from engines.prefix_cache.store import NOT_REUSABLE
from engines.speculation.lane import DrafterFactory
from engines.speculation.prompt_lookup import PromptLookup
from errors import ChannelError, EngineError

log = logging.getLogger(__name__)

DEFAULT_TOKEN_TIMEOUT_S = 10.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0


class EncryptedPipelineEngine(PrefixKeeping, SharedPrompts, DiskRelisting, ChainUpkeep, Engine):
    """Pipeline parallel over sealed hops: this process -> stage 1 -> ... -> last -> this process.

    Stage 0 (embeddings and the first layers) runs here on the runner thread; the stage worker
    processes run the rest, and the last one samples and sends the tokens back. The batch is
    split into `micro_batches` (default: one per stage) that travel the chain one behind the
    other, so every stage computes at once; each step() sends whatever is ready and returns
    the tokens of the one micro-batch that comes back. Every read has a timeout; a lost stage
    turns into EngineError for the whole batch and healthy() == False.

    A relay: stage 0 may hold no layers (`layers` [0, 0)): it only embeds, and one remote
    stage runs the whole model. That is how a model runs alone on an agent while this
    process keeps its scheduler; one micro-batch, no disk tier.

    Speculation (`options.most_drafted` > 0): a sequence decoding alone, which the last stage
    only samples, sends its next token and a prompt-lookup draft in one verifying frame and gets
    back a token per position (speculation.py); greedy and seeded tokens are those of plain
    decoding. Not with quantized KV, sliding windows or recurrent layers.

    Prefix cache (`options.prefix_cache_bytes` > 0): this coordinator's PrefixIndex decides hits
    and evictions; every stage (stage 0 here too) keeps its own layers of each entry in its
    StageBatches' PrefixStore under the same entry id (the uid of the sequence it came from).
    A BEGIN names the entry and starts at the cached length; an END tells every stage which
    ended sequences to keep and which entries to drop or spill. A request sharing a long
    prefix with a prompt still being prefilled waits for it and starts from its KV
    (shared_prompts.py). Entries in memory live as long as the session. With a disk tier
    (`prefix_cache_disk_bytes` and stage 0's machine directory `prefix_cache_dir`; every
    stage has its own), what the index evicts is spilled to disk, and every new session
    lists what is there again (disk_relisting.py).
    """

    # all at the last stage (the request BEGIN carries); a grammar is checked here first
    features = frozenset({"penalties", "logprobs", "grammar"})
    refusal_function = "engines.pipeline.admission:request_refusal"

    def __init__(
        self,
        model_path: Path,
        layers: range,
        stages: Sequence[StageAddress | Mapping[str, Any]],
        return_listen_host: str,
        cluster_key: bytes,
        token_timeout_s: float = DEFAULT_TOKEN_TIMEOUT_S,
        options: EngineOptions = DEFAULT_OPTIONS,
        *,
        micro_batches: int | None = None,
        return_listen_port: int = 0,
        return_listener: socket.socket | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        channel_class: Any = SecureChannel,
        drafter: DrafterFactory = PromptLookup,
    ) -> None:
        """`options` are stage 0's (each remote stage's spec carries its own); their
        `most_drafted` bounds the tokens drafted per verifying pass. `drafter` makes a
        sequence's drafter from its tokens (tests script one).
        `return_listener`: an already listening socket for the last stage's connection (its
        port must be known before the last stage starts); else one is opened on
        return_listen_host:return_listen_port. `channel_class` exists only so the benchmark
        can price sealing; keep the default."""
        if not stages:
            raise EngineError("a pipeline needs at least one remote stage; use SingleEngine")
        if layers.start != 0:
            raise EngineError(f"stage 0 must start at layer 0, got [{layers.start}, {layers.stop})")
        # A relay (stage 0 without layers) keeps one micro-batch per stage that computes.
        groups = micro_batches if micro_batches is not None else bool(layers) + len(stages)
        if token_timeout_s <= 0 or connect_timeout_s <= 0 or groups < 1:
            raise EngineError(
                "invalid pipeline settings: "
                f"token_timeout_s={token_timeout_s}, connect_timeout_s={connect_timeout_s}, "
                f"micro_batches={micro_batches}"
            )
        self.model_path = Path(model_path)
        self.layers = layers
        self.stages = [StageAddress.of(stage) for stage in stages]
        self.return_listen_host = return_listen_host
        self.return_listen_port = return_listen_port
        self.token_timeout_s = token_timeout_s
        self.options = options
        self.connect_timeout_s = connect_timeout_s
        self._cluster_key = cluster_key
        self._channel_class = channel_class
        self.tokenizer = None
        self.stage: StageModel | None = None
        self._weight_bytes = 0  # stage 0's, in this process
        self._relay_kv_bytes_per_token = 0  # set at load when stage 0 holds no layers
        self._listener: socket.socket | None = return_listener
        self._chain: Chain | None = None
        self._schedule = MicroBatchSchedule(
            groups,
            options.prefill_chunk,
            1 + len(stages),
            options.quantized_kv_start if options.kv_bits else None,
        )
        self._local: StageBatches | None = None  # stage 0's caches
        self._sampling: dict[int, GenerationRequest] = {}  # as BEGIN carries it
        self._grammars: GrammarCompiler | None = None  # checks grammars before the chain does
        self._awaiting: deque[wire.Frame] = deque()  # the answers due, in the order sent
        self._number = 0  # the last frame number sent down this session
        self._healthy = False
        self._failure: str | None = None
        self._abort_reason: str | None = None
        self._io_lock = threading.Lock()
        # A relay has no layers to spill and its disk list would be empty: no disk tier.
        disk_dir = options.prefix_cache_dir
        disk_bytes = options.prefix_cache_disk_bytes if disk_dir is not None and layers else 0
        index = PrefixIndex(options.prefix_cache_bytes, disk_bytes=disk_bytes)
        # hits (pinned until their sequence begins), waiters, late counts and END orders
        self.books = PrefixBooks(index, TOP_PRIVATE_ENTRY_ID)
        self._disk_dir = Path(disk_dir) if disk_bytes else None
        self._disk: ChainDiskTier | None = None  # stage 0's share of the disk tier
        self._verifying: list[int] = []  # uids whose disk entry no stage was asked for yet
        self._loads: dict[int, tuple[list[int], list[int]]] = {}  # roll call -> uids, failed
        self.step_timing = StepTimes()  # per answered frame: stages, sealing, hops
        self._clock: FrameClock | None = None  # the current session's (frame_clock.py)
        self.speculation = PipelineSpeculation(options.most_drafted, drafter)

    @property
    def prefix_index(self) -> PrefixIndex:
        return self.books.index

    # -- lifecycle ---------------------------------------------------------------------------

    def open_return_listener(self) -> int:
        """Listen for the last stage's connection; returns the port (call before the workers
        start when the port is 0 = any). Idempotent."""
        if self._listener is None:
            try:
                self._listener = socket.create_server(
                    (self.return_listen_host, self.return_listen_port), backlog=4
                )
            except OSError as error:
                raise EngineError(
                    f"cannot listen for the last pipeline stage on "
                    f"{self.return_listen_host}:{self.return_listen_port}: {error}"
                ) from error
        return self._listener.getsockname()[1]

    def load(self) -> None:
        try:
            self.tokenizer = load_serving_tokenizer(self.model_path)
        except (OSError, ValueError) as error:
            raise EngineError(f"cannot load the tokenizer of {self.model_path}: {error}") from error
        options = self.options
        self.stage = StageModel.load(
            self.model_path, self.layers, False, options.upcast, options.kv_bits,
            options.quantized_kv_start,
        )  # fmt: skip
        stage = self.stage
        parts = (*stage.blocks, stage.embed_tokens, stage.norm, stage.head)
        self._weight_bytes = parameter_bytes(*parts)
        if not self.layers:  # a relay: its prefix entries are counted from the model's shape
            shape = inspect_model(self.model_path).to_shape(
                options.upcast, options.kv_bits, options.quantized_kv_start
            )
            self._relay_kv_bytes_per_token = shape.prefix_kv_bytes_per_token
        self._load_grammars()
        windows = self.stage.layout.windows  # every layer's, the whole chain's
        self.speculation.check_model(self.stage.make_cache(), windows, options.kv_bits)
        if any(window is not None for window in self.stage.layout.windows):
            self.prefix_index.turn_off(NOT_REUSABLE)  # windows anywhere in the chain
        if self.prefix_index.disk_max_bytes and self._disk is None:  # each session opens it
            self._disk = chain_disk_tier(
                self._disk_dir, self.model_path, self.layers, options.kv_bits,
                options.quantized_kv_start,
            )  # fmt: skip
        chunk_bytes = options.prefill_chunk * self.stage.hidden_size * 4
        if chunk_bytes > wire.MAX_FRAME_BYTES:
            raise EngineError(
                f"a prefill chunk of {options.prefill_chunk} tokens x {self.stage.hidden_size} "
                f"would exceed the {wire.MAX_FRAME_BYTES}-byte frame limit; lower prefill_chunk"
            )
        self.open_return_listener()
        self.connect()

    def _load_grammars(self) -> None:
        """The compiler that checks grammars here, ready before the first constrained insert
        (which would otherwise stall the chain); without one, "grammar" leaves `features` and
        the API refuses constrained requests by name."""
        try:
            vocab_size = max(self.stage.vocab_size, len(self.tokenizer))
            self._grammars = GrammarCompiler(self.tokenizer, vocab_size)
            self._grammars.prepare()
        except Exception as error:  # noqa: BLE001 (llguidance refusing a tokenizer costs grammars)
            log.warning("no output grammars: llguidance cannot use this tokenizer: %s", error)
            self._grammars = None
            self.features = type(self).features - {"grammar"}

    def connect(self) -> None:
        """(Re)build the sealed chain with fresh session keys and run the SETUP roll call."""
        if self.stage is None:
            raise EngineError("pipeline engine used before load()")
        with self._io_lock:
            if self._schedule.active:
                raise EngineError(
                    f"cannot rebuild the pipeline while {self._schedule.active} sequences run on it"
                )
            self._open()

    def memory_held(self) -> dict[str, int]:
        return {"weights": self._weight_bytes}

    def close(self) -> None:
        self._healthy = False
        self._close_chain()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self.stage = None
        self._weight_bytes = 0
        if self._local is not None:
            self._local.prefix.close()  # the disk tier's files stay for the next run
        self._local = None
        self.books.clear_waiters()
        self._forget_prefix_cache()
        if self._disk is not None:
            self._disk.close()
            self._disk = None
        mx.clear_cache()

    def abort(self, reason: str) -> None:
        """From any thread: close the hops so a blocked read returns at once with EngineError.
        The first reason stays until the chain reconnects: a re-plan aborts naming the lost
        member, then closing the old runner aborts again, and the step the first abort
        unblocks may only now be reading it."""
        if self._abort_reason is None:
            self._abort_reason = reason
        self._fail(f"aborted: {reason}")
        self._close_chain()

    def healthy(self) -> bool:
        return self._healthy

    def info(self) -> EngineInfo:
        addresses = ["coordinator", *(f"{stage.host}:{stage.port}" for stage in self.stages)]
        reports = self._chain.reports if self._chain is not None else []
        stages = [
            {
                "stage": index,
                "address": address,
                "layers": list(report["layers"]),
                "peak_memory_bytes": report.get("peak_memory_bytes"),
            }
            for index, (address, report) in enumerate(zip(addresses, reports, strict=False))
        ]
        detail: dict[str, Any] = {
            "model_path": str(self.model_path),
            "stages": stages,
            "prefill_chunk": self.options.prefill_chunk,
            "kv_bits": self.options.kv_bits,
            "quantized_kv_start": self.options.quantized_kv_start,
            "micro_batches": self._schedule.groups,
            "healthy": self._healthy,
            "prefix_cache": self.books.snapshot(),
            # prompt tokens stage 0 (as every stage) ran in prefill chunks, this session
            "prefilled_tokens": self._local.prefilled_tokens if self._local is not None else 0,
            "step_timing": self.step_timing.snapshot(),
        }
        speculation = self.speculation.snapshot()
        if speculation is not None:
            detail["speculation"] = speculation
        if self._failure:
            detail["failure"] = self._failure
        strategy = "pp" if self.layers else "single"  # a relay serves its plan's single
        return EngineInfo(strategy=strategy, world_size=1 + len(self.stages), detail=detail)

    # -- the batch ---------------------------------------------------------------------------

    def insert(self, uid: int, request: GenerationRequest) -> int:
        if self.stage is None:
            raise EngineError("pipeline engine used before load()")
        if not request.prompt_tokens:
            raise EngineError("the prompt is empty: a request needs at least one token")
        sampling = sampling_of(request)
        refusal = self.refusal(request, sampling)
        if refusal is not None:
            raise EngineError(refusal)
        self._check_grammar(request)
        with self._io_lock:  # the index is shared with evict_prefix_cache()
            self._sampling[uid] = sampling
            if self.books.hold(uid, request):
                return 0  # its first output will say how many tokens it reused
            return self._admit(uid, request.prompt_tokens)

    def refusal(
        self, request: GenerationRequest, sampling: GenerationRequest | None = None
    ) -> str | None:
        return wire_refusal(request, sampling or sampling_of(request))

    def _check_grammar(self, request: GenerationRequest) -> None:
        """Refuse here, for this request alone, a grammar the last stage could not compile."""
        if request.grammar is None:
            return
        if self._grammars is None:
            raise EngineError(
                f"request {request.request_id}: this model's tokenizer cannot apply output grammars"
            )
        try:  # the last stage compiles it with the same tokenizer: a failure would be there too
            self._grammars.processor(request.grammar)
        except EngineError as error:
            raise EngineError(f"request {request.request_id}: {error}") from None

    def remove(self, uids: Sequence[int]) -> None:
        self.step_timing.forget(uids)
        with self._io_lock:
            local = self._local
            connected = local is not None and self._chain is not None and self._healthy
            keep = self._caches_to_keep(uids) if connected else []
            known = self._schedule.remove(uids)
            self.books.forget(uids)  # entries held for them are ordered dropped
            self.speculation.forget(uids)
            for uid in uids:
                self._sampling.pop(uid, None)
            if local is None:
                return
            if not connected:  # the session is gone, and the stages' caches with it
                local.end(known)
                self.books.take_orders()  # no stage is left to carry them out
                return
            self._keep_on_stage_zero(keep)
            local.end(known)
            orders = self._orders_on_stage_zero()
            if not known and not orders:
                return
            try:
                kept = [(uid, len(tokens)) for uid, tokens in keep]
                self._send_end(orders, known, kept)
            except ChannelError as error:
                raise self._lost(f"ending sequences {known}", error) from error

    def step_times(self, uid: int) -> dict[str, float]:
        return self.step_timing.request(uid)

    def evict_prefix_cache(self, keep_fraction: float) -> int:
        """Drop least recently used prefix-cache entries on every stage until at most
        `keep_fraction` of the cached bytes remain; returns the bytes freed (estimated)."""
        with self._io_lock:
            freed = self.books.evict(keep_fraction)
            if self._local is None:
                return freed  # no session yet: opening one forgets the orders
            orders = self._orders_on_stage_zero()
            if orders and self._chain is not None and self._healthy:
                try:
                    self._send_end(orders)
                except ChannelError as error:
                    raise self._lost("evicting prefix-cache entries", error) from error
            return freed

    def step(self) -> list[StepOutput]:
        if self.stage is None:
            raise EngineError("pipeline engine used before load()")
        with self._io_lock:
            self._ensure_connected()
            expected = None
            try:
                self._let_in(self.books.released())  # owners gone, or waited long enough
                self._send_loads()  # sequences starting from disk entries: read them back
                drafts = self._draft if self.speculation.possible else None
                for planned in self._schedule.plan(drafts):
                    self._run_stage_zero(planned)
                if not self._awaiting:
                    return []
                expected = self._awaiting[0]
                produced, scores, verdict = self._receive_answer()
                recount = {uid: self.books.late_cached(uid) for uid in dict(produced)}
                self._share_prompts(produced)  # owners' prompts done: their waiters go in
            except ChannelError as error:
                waiting = f"for {expected.describe()}" if expected else "sending"
                raise self._lost(waiting, error) from error
            except Exception as error:  # the stages are mid-batch: this chain is unusable now
                self._lost("in a step", ChannelError(str(error)))
                raise
        outputs = []
        for uid, token in produced:  # a sequence's first output corrects its cached count
            outputs.append(_output(uid, token, scores.get(uid), recount.pop(uid, None)))
        if verdict is not None:  # a verifying pass: its drafted and accepted on the first
            outputs[0] = replace(outputs[0], drafted=verdict[0], accepted=verdict[1])
        return outputs

    def _draft(self, uid: int) -> list[int]:
        """The draft of a sequence decoding alone: none once max_tokens is near."""
        request = self._sampling[uid]
        room = request.max_tokens - self._schedule.produced(uid) - 1
        return self.speculation.draft(uid, request, self._schedule.tokens(uid), room)

    def _run_stage_zero(self, planned: Planned) -> None:
        """BEGIN the newcomers, embed and run stage 0 over the frame's tokens, send it down."""
        for uid in planned.begins:
            hit = self.books.pinned(uid)
            start, entry = (hit.tokens, hit.entry_id) if hit is not None else (0, None)
            self._local.begin(uid, start, entry)
            begin = self._sampling[uid].document()
            if entry is not None:
                begin["prefix_entry"] = entry
            number = self._take_number()
            self._send(wire.document_frame(Kind.BEGIN, number, begin, [Row(uid, start)]))
        self.books.begun(planned.begins)
        orders = self._orders_on_stage_zero()
        if orders:  # entries dropped while these sequences waited to begin from them
            self._send_end(orders)
        started = time.perf_counter()
        tokens = mx.array(planned.tokens, dtype=mx.uint32)
        group, step, rows = planned.group, planned.step, planned.rows
        if planned.is_prefill:
            hidden = self._local.prefill(rows[0], self.stage.embed(tokens[None]))  # (1, L, D)
        elif planned.verifies:  # one row: its next token and draft
            hidden = self._local.decode(group, rows, self.stage.embed(tokens[None]))  # (1, L, D)
        else:
            hidden = self._local.decode(group, rows, self.stage.embed(tokens[:, None]))  # (B, 1, D)
        mx.eval(hidden)
        stage_zero_s = time.perf_counter() - started
        number = self._take_number()
        flags = wire.LAST_CHUNK if planned.last_chunk else 0  # the last stage samples it
        flags |= wire.VERIFY if planned.verifies else 0  # ... every position of it
        self._send(wire.hidden_frame(number, group, step, rows, hidden, flags=flags))
        self._clock.sent(number, stage_zero_s)
        self._awaiting.append(wire.Frame(Kind.TOKEN, number, group, step, rows, flags))

    def _receive_answer(
        self,
    ) -> tuple[list[tuple[int, int]], dict[int, wire.Score], tuple[int, int] | None]:
        """The next answer: (uid, token) produced, rows' scores, and for a verifying pass
        (drafted, accepted)."""
        expected = self._awaiting[0]
        chain = self._chain
        if chain is None:
            raise ChannelError(self._abort_reason or "the pipeline is not connected")
        answer = wire.receive_answer(
            chain.inbound, self.token_timeout_s, expected, chain.last_layers
        )
        self._awaiting.popleft()
        if expected.kind is Kind.READY:  # disk entries read back (prefix_keeping.py)
            self._loaded(expected.number, answer.document().get("reports"))
            return [], {}, None
        if self._clock is not None:
            segments = self._clock.answered(expected.number, answer.times)
            # rows removed while their frame was out are not charged (nor kept)
            running = [uid for uid in expected.uids if uid in self._schedule]
            # a 1-stream token: a decode step while no other sequence shares the pipeline
            # (a verifying pass is several positions' work, not one token's cost)
            plain = not expected.is_prefill and not expected.verifies
            alone = plain and self._schedule.active == 1
            self.step_timing.observe(segments, running, decode=alone)
        scores = {}
        if answer.flags & wire.SCORES:
            scores = dict(zip(answer.uids, answer.scores(), strict=True))
        planned = self._schedule.expected()
        produced = self._schedule.answered(answer.tokens())
        for uid, token in produced:
            self.speculation.answered(uid, (token,))
        verdict = self._verified(planned) if planned.verifies and produced else None
        return produced, scores, verdict

    def _verified(self, planned: Planned) -> tuple[int, int]:
        """A verifying pass answered: stage 0 trims the positions rejected at once (the other
        stages when the sequence's next frame or END says where it is)."""
        uid = planned.rows[0].uid
        row = Row(uid, self._schedule.position(uid))
        self._local.roll_back(planned.group, (row,))
        drafted = len(planned.draft)
        accepted = row.position - planned.rows[0].position - 1
        self.speculation.verified(uid, drafted, accepted)
        return drafted, accepted


def _output(uid: int, token: int, score: wire.Score, cached: int | None) -> StepOutput:
    """A row of a TOKEN answer as the runner sees it: a token (with its logprobs if asked),
    or the last stage's refusal of this sequence alone; `cached` corrects insert()'s count."""
    if isinstance(score, str):
        return StepOutput(uid, error=f"the last pipeline stage refused the sequence: {score}")
    logprob, top = score if score is not None else (None, ())
    return StepOutput(uid, token, None, logprob, top, cached_tokens=cached)
