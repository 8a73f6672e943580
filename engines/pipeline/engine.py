"""EncryptedPipelineEngine: stage 0 here, sealed micro-batches in flight down a chain of stages."""

from __future__ import annotations

import logging
import socket
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.utils import load_config, load_tokenizer

from discovery.secure_channel import SecureChannel
from planner.errors import ChannelError, EngineError

from ..base import Engine, EngineInfo, GenerationRequest, StepOutput
from ..sampling import request_seed
from . import wire
from .batches import StageBatches
from .chain import Chain, open_chain
from .schedule import MicroBatchSchedule, Planned
from .stage_model import StageModel
from .wire import Kind, Row

log = logging.getLogger(__name__)

DEFAULT_TOKEN_TIMEOUT_S = 10.0
DEFAULT_PREFILL_CHUNK = 256
DEFAULT_CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class StageAddress:
    """Where a remote stage listens; `layers` (optional) is checked against what it reports."""

    host: str
    port: int
    layers: range | None = None

    @classmethod
    def of(cls, value: StageAddress | Mapping[str, Any]) -> StageAddress:
        if isinstance(value, StageAddress):
            return value
        layers = value.get("layers")
        return cls(str(value["host"]), int(value["port"]), range(*layers) if layers else None)


class EncryptedPipelineEngine(Engine):
    """Pipeline parallel over sealed hops: this process -> stage 1 -> ... -> last -> this process.

    Stage 0 (embeddings and the first layers) runs here on the runner thread; the stage worker
    processes run the rest, and the last one samples and sends the tokens back. The batch is
    split into `micro_batches` (default: one per stage) that travel the chain one behind the
    other, so every stage computes at once; each step() sends whatever is ready and returns
    the tokens of the one micro-batch that comes back. Every read has a timeout; a lost stage
    turns into EngineError for the whole batch and healthy() == False.
    """

    features = frozenset({"penalties", "logprobs"})  # both at the last stage (wire.Sampling)

    def __init__(
        self,
        model_path: Path,
        layers: range,
        stages: Sequence[StageAddress | Mapping[str, Any]],
        return_listen_host: str,
        cluster_key: bytes,
        token_timeout_s: float = DEFAULT_TOKEN_TIMEOUT_S,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        *,
        micro_batches: int | None = None,
        return_listen_port: int = 0,
        return_listener: socket.socket | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        channel_class: Any = SecureChannel,
        upcast: bool = False,
    ) -> None:
        """`return_listener`: an already listening socket for the last stage's connection (its
        port must be known before the last stage starts); else one is opened on
        return_listen_host:return_listen_port. `channel_class` exists only so the benchmark
        can price sealing; keep the default."""
        if not stages:
            raise EngineError("a pipeline needs at least one remote stage; use SingleEngine")
        if layers.start != 0 or len(layers) < 1:
            raise EngineError(f"stage 0 must start at layer 0, got [{layers.start}, {layers.stop})")
        groups = micro_batches if micro_batches is not None else 1 + len(stages)
        if prefill_chunk < 1 or token_timeout_s <= 0 or connect_timeout_s <= 0 or groups < 1:
            raise EngineError(
                f"invalid pipeline settings: prefill_chunk={prefill_chunk}, "
                f"token_timeout_s={token_timeout_s}, connect_timeout_s={connect_timeout_s}, "
                f"micro_batches={micro_batches}"
            )
        self.model_path = Path(model_path)
        self.layers = layers
        self.stages = [StageAddress.of(stage) for stage in stages]
        self.return_listen_host = return_listen_host
        self.return_listen_port = return_listen_port
        self.token_timeout_s = token_timeout_s
        self.prefill_chunk = prefill_chunk
        self.connect_timeout_s = connect_timeout_s
        self._cluster_key = cluster_key
        self._channel_class = channel_class
        self.upcast = upcast  # half-precision weights to float32 on the CPU
        self.tokenizer = None
        self.stage: StageModel | None = None
        self._listener: socket.socket | None = return_listener
        self._chain: Chain | None = None
        self._schedule = MicroBatchSchedule(groups, prefill_chunk, 1 + len(stages))
        self._local: StageBatches | None = None  # stage 0's caches
        self._sampling: dict[int, wire.Sampling] = {}
        self._awaiting: deque[wire.Frame] = deque()  # the answers due, in the order sent
        self._number = 0  # the last frame number sent down this session
        self._healthy = False
        self._failure: str | None = None
        self._abort_reason: str | None = None
        self._io_lock = threading.Lock()

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
            config = load_config(self.model_path)
            self.tokenizer = load_tokenizer(
                self.model_path, eos_token_ids=config.get("eos_token_id")
            )
        except (OSError, ValueError) as error:
            raise EngineError(f"cannot load the tokenizer of {self.model_path}: {error}") from error
        self.stage = StageModel.load(self.model_path, self.layers, False, self.upcast)
        chunk_bytes = self.prefill_chunk * self.stage.hidden_size * 4
        if chunk_bytes > wire.MAX_FRAME_BYTES:
            raise EngineError(
                f"a prefill chunk of {self.prefill_chunk} tokens x {self.stage.hidden_size} "
                f"would exceed the {wire.MAX_FRAME_BYTES}-byte frame limit; lower prefill_chunk"
            )
        self.open_return_listener()
        self.connect()

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

    def close(self) -> None:
        self._healthy = False
        self._close_chain()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self.stage = None
        self._local = None
        mx.clear_cache()

    def abort(self, reason: str) -> None:
        """From any thread: close the hops so a blocked read returns at once with EngineError."""
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
            "prefill_chunk": self.prefill_chunk,
            "micro_batches": self._schedule.groups,
            "healthy": self._healthy,
        }
        if self._failure:
            detail["failure"] = self._failure
        return EngineInfo(strategy="pp", world_size=1 + len(self.stages), detail=detail)

    def stage_status(self) -> list[dict[str, Any]]:
        """A STATUS roll call (while no sequence runs): every stage's layers and counters."""
        if not self._io_lock.acquire(timeout=self.token_timeout_s):
            raise EngineError("the pipeline is busy; status unavailable")
        try:
            if self._schedule.active:
                raise EngineError(f"the pipeline runs {self._schedule.active} sequences")
            self._ensure_connected()
            try:
                while self._awaiting:  # answers for sequences already removed
                    self._receive_answer()
                reports = [self._local_report()]
                number = self._take_number()
                self._send(wire.document_frame(Kind.STATUS, number, {"reports": reports}))
                expected = wire.Frame(Kind.READY, number)
                answer = wire.receive_answer(
                    self._chain.inbound, self.token_timeout_s, expected, self._chain.last_layers
                )
                return list(answer.document()["reports"])
            except ChannelError as error:
                raise self._lost("waiting for the status roll call", error) from error
        finally:
            self._io_lock.release()

    # -- the batch ---------------------------------------------------------------------------

    def insert(self, uid: int, request: GenerationRequest) -> None:
        if self.stage is None:
            raise EngineError("pipeline engine used before load()")
        if not request.prompt_tokens:
            raise EngineError("the prompt is empty: a request needs at least one token")
        sampling = wire.Sampling(
            request.temperature,
            request.top_p,
            request_seed(request),
            request.request_id,
            request.repetition_penalty,
            request.presence_penalty,
            request.frequency_penalty,
            request.prompt_tokens[-wire.PENALTY_CONTEXT :],
            request.logprobs,
        )
        try:
            wire.Sampling.of(sampling.document())  # refuse here what the last stage would
        except wire.WireError as error:
            raise EngineError(f"request {request.request_id}: {error}") from None
        self._schedule.add(uid, request.prompt_tokens)
        self._sampling[uid] = sampling

    def remove(self, uids: Sequence[int]) -> None:
        known = self._schedule.remove(uids)
        for uid in uids:
            self._sampling.pop(uid, None)
        if not known or self._local is None:
            return
        self._local.end(known)
        with self._io_lock:
            if self._chain is None or not self._healthy:
                return  # the session is gone, and the stages' caches with it
            try:
                self._send(wire.end_frame(self._take_number(), known))
            except ChannelError as error:
                raise self._lost(f"ending sequences {known}", error) from error

    def step(self) -> list[StepOutput]:
        if self.stage is None:
            raise EngineError("pipeline engine used before load()")
        with self._io_lock:
            self._ensure_connected()
            expected = None
            try:
                for planned in self._schedule.plan():
                    self._run_stage_zero(planned)
                if not self._awaiting:
                    return []
                expected = self._awaiting[0]
                produced, scores = self._receive_answer()
            except ChannelError as error:
                waiting = f"for {expected.describe()}" if expected else "sending"
                raise self._lost(waiting, error) from error
            except Exception as error:  # the stages are mid-batch: this chain is unusable now
                self._lost("in a step", ChannelError(str(error)))
                raise
        return [
            StepOutput(uid, token)
            if scores.get(uid) is None
            else StepOutput(uid, token, None, *scores[uid])
            for uid, token in produced
        ]

    def _run_stage_zero(self, planned: Planned) -> None:
        """BEGIN the newcomers, embed and run stage 0 over the frame's tokens, send it down."""
        for uid in planned.begins:
            self._local.begin(uid)
            begin = self._sampling[uid].document()
            self._send(wire.document_frame(Kind.BEGIN, self._take_number(), begin, [Row(uid, 0)]))
        tokens = mx.array(planned.tokens, dtype=mx.uint32)
        group, step, rows = planned.group, planned.step, planned.rows
        if planned.is_prefill:
            hidden = self._local.prefill(rows[0], self.stage.embed(tokens[None]))  # (1, L, D)
        else:
            hidden = self._local.decode(group, rows, self.stage.embed(tokens[:, None]))  # (B, 1, D)
        mx.eval(hidden)
        number = self._take_number()
        self._send(wire.hidden_frame(number, group, step, rows, hidden))
        self._awaiting.append(wire.Frame(Kind.TOKEN, number, group, step, rows))

    def _receive_answer(self) -> tuple[list[tuple[int, int]], dict[int, Any]]:
        expected = self._awaiting[0]
        chain = self._chain
        if chain is None:
            raise ChannelError(self._abort_reason or "the pipeline is not connected")
        answer = wire.receive_answer(
            chain.inbound, self.token_timeout_s, expected, chain.last_layers
        )
        self._awaiting.popleft()
        scores = dict(zip(answer.uids, answer.scores(), strict=True)) if answer.flags else {}
        return self._schedule.answered(answer.tokens()), scores

    # -- the hops ----------------------------------------------------------------------------

    def _take_number(self) -> int:
        """The next frame number down the chain: every stage expects them one by one."""
        self._number += 1
        return self._number

    def _send(self, frame: wire.Frame) -> None:
        chain = self._chain
        if chain is None:
            raise ChannelError(self._abort_reason or "the pipeline is not connected")
        wire.send(chain.outbound, frame, self.layers)

    def _ensure_connected(self) -> None:
        if self._chain is None or not self._healthy:
            log.info("pipeline not connected (%s); reconnecting", self._failure or "new")
            self._open()

    def _open(self) -> None:
        self._close_chain()
        self._abort_reason = None
        first = self.stages[0]
        self.open_return_listener()
        try:
            self._chain = open_chain(
                (first.host, first.port),
                self._listener,
                self._cluster_key,
                self._local_report(),
                [stage.layers for stage in self.stages],
                self.stage.total_layers,
                self.connect_timeout_s,
                self._channel_class,
            )
        except (ChannelError, EngineError) as error:
            self._fail(str(error))
            if isinstance(error, EngineError):
                raise
            raise EngineError(
                f"cannot build the pipeline through stage 1 at {first.host}:{first.port}: {error}"
            ) from error
        self._local = StageBatches(self.stage)
        self._schedule.restart()
        self._awaiting.clear()
        self._number = 0
        self._healthy, self._failure = True, None
        log.info(
            "pipeline ready (%d micro-batches): %s",
            self._schedule.groups,
            " -> ".join(f"[{r['layers'][0]}, {r['layers'][1]})" for r in self._chain.reports),
        )

    def _local_report(self) -> dict[str, Any]:
        return {
            "layers": [self.layers.start, self.layers.stop],
            "peak_memory_bytes": self.stage.peak_memory_bytes,
            "active_requests": self._local.active if self._local is not None else 0,
        }

    # -- failure -----------------------------------------------------------------------------

    def _lost(self, context: str, error: ChannelError) -> EngineError:
        """Mark the chain broken, close it, drop the batch, and say why (abort reason first)."""
        aborted = self._abort_reason
        self._fail(f"aborted: {aborted}" if aborted else str(error))
        self._close_chain()
        lost = self._schedule.active
        self._schedule.clear()
        self._sampling.clear()
        self._awaiting.clear()
        if aborted:
            return EngineError(f"pipeline aborted {context} ({lost} sequences): {aborted}")
        return EngineError(f"pipeline stage lost {context} ({lost} sequences): {error}")

    def _fail(self, reason: str) -> None:
        if self._healthy:
            log.error("pipeline marked unhealthy: %s", reason)
        self._healthy = False
        self._failure = reason

    def _close_chain(self) -> None:
        chain, self._chain = self._chain, None
        if chain is not None:
            chain.close()
