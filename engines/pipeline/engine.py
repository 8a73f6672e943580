"""EncryptedPipelineEngine: stage 0 in this process, sealed activations down a chain of stages."""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.utils import load_config, load_tokenizer

from discovery.framing import connect
from discovery.secure_channel import SecureChannel
from planner.errors import ChannelError, EngineError

from ..base import Engine, EngineInfo, GenerationRequest, StepOutput
from ..sampling import request_seed
from . import wire
from .stage_model import StageModel
from .wire import PURPOSE, Kind

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
    processes run the rest, and the last one samples and sends the token back. Every read has
    a timeout; a lost stage turns into EngineError and healthy() == False.
    """

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
        if prefill_chunk < 1 or token_timeout_s <= 0 or connect_timeout_s <= 0:
            raise EngineError(
                f"invalid pipeline settings: prefill_chunk={prefill_chunk}, "
                f"token_timeout_s={token_timeout_s}, connect_timeout_s={connect_timeout_s}"
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
        self._outbound: Any = None  # channel to stage 1
        self._inbound: Any = None  # channel from the last stage
        self._last_layers: range | None = None
        self._reports: list[dict[str, Any]] = []
        self._next_request = 1
        self._healthy = False
        self._failure: str | None = None
        self._abort_reason: str | None = None
        self._io_lock = threading.Lock()
        self._waiting: deque[tuple[int, GenerationRequest]] = deque()
        self._current: tuple[int, Iterator[int]] | None = None

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
        self._close_channels()
        self._abort_reason = None
        first = self.stages[0]
        deadline = time.monotonic() + self.connect_timeout_s
        try:
            sock = connect(first.host, first.port, self.connect_timeout_s)
            self._outbound = self._channel_class.client(
                sock, self._cluster_key, PURPOSE, self.connect_timeout_s
            )
            self._inbound = self._accept_last_stage(sock, deadline)
            self._setup(deadline)
        except (ChannelError, EngineError) as error:
            self._close_channels()
            self._fail(str(error))
            if isinstance(error, EngineError):
                raise
            raise EngineError(
                f"cannot build the pipeline through stage 1 at {first.host}:{first.port}: {error}"
            ) from error
        self._healthy, self._failure = True, None
        log.info(
            "pipeline ready: %s",
            " -> ".join(f"[{r['layers'][0]}, {r['layers'][1]})" for r in self._reports),
        )

    def close(self) -> None:
        self._healthy = False
        self._close_channels()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self.stage = None
        mx.clear_cache()

    def abort(self, reason: str) -> None:
        """From any thread: close the hops so a blocked read returns at once with EngineError."""
        self._abort_reason = reason
        self._fail(f"aborted: {reason}")
        self._close_channels()

    def healthy(self) -> bool:
        return self._healthy

    def info(self) -> EngineInfo:
        addresses = ["coordinator", *(f"{stage.host}:{stage.port}" for stage in self.stages)]
        stages = [
            {
                "stage": index,
                "address": address,
                "layers": list(report["layers"]),
                "peak_memory_bytes": report.get("peak_memory_bytes"),
            }
            for index, (address, report) in enumerate(zip(addresses, self._reports, strict=False))
        ]
        detail: dict[str, Any] = {
            "model_path": str(self.model_path),
            "stages": stages,
            "prefill_chunk": self.prefill_chunk,
            "healthy": self._healthy,
        }
        if self._failure:
            detail["failure"] = self._failure
        return EngineInfo(strategy="pp", world_size=1 + len(self.stages), detail=detail)

    def stage_status(self) -> list[dict[str, Any]]:
        """A STATUS roll call: every stage's layers, active and served request counts."""
        if not self._io_lock.acquire(timeout=self.token_timeout_s):
            raise EngineError("the pipeline is busy with a request; status unavailable")
        try:
            self._ensure_connected()
            request = self._take_request_number()
            reports = [self._local_report(active=0)]
            try:
                self._send(wire.document_frame(Kind.STATUS, request, 0, {"reports": reports}))
                answer = self._receive(self.token_timeout_s, request, 0, (Kind.READY,))
                return list(answer.document()["reports"])
            except ChannelError as error:
                raise self._lost("waiting for the status roll call", error) from error
        finally:
            self._io_lock.release()

    # -- generation --------------------------------------------------------------------------

    # -- the batch: one sequence through the chain at a time ---------------------------------

    def insert(self, uid: int, request: GenerationRequest) -> None:
        if not request.prompt_tokens:
            raise EngineError("the prompt is empty: a request needs at least one token")
        self._waiting.append((uid, request))

    def remove(self, uids: Sequence[int]) -> None:
        gone = set(uids)
        self._waiting = deque(entry for entry in self._waiting if entry[0] not in gone)
        if self._current is not None and self._current[0] in gone:
            _, tokens = self._current
            self._current = None
            tokens.close()  # sends END down the chain when the sequence ended cleanly

    def step(self) -> list[StepOutput]:
        """Advance the oldest sequence by one token; the others wait their turn."""
        if self._current is None:
            if not self._waiting:
                return []
            uid, request = self._waiting.popleft()
            self._current = (uid, self.generate_tokens(request))
        uid, tokens = self._current
        try:
            return [StepOutput(uid, next(tokens))]
        except StopIteration:
            self._current = None
            return []
        except EngineError:
            self._current = None
            self._waiting.clear()
            raise

    def generate_tokens(self, request: GenerationRequest) -> Iterator[int]:
        if not request.prompt_tokens:
            raise EngineError("the prompt is empty: a request needs at least one token")
        if not self._io_lock.acquire(timeout=self.token_timeout_s):
            raise EngineError("the pipeline is still busy with another request")
        try:
            yield from self._generate(request)
        finally:
            self._io_lock.release()

    def _generate(self, request: GenerationRequest) -> Iterator[int]:
        sampling = wire.Sampling(
            request.temperature, request.top_p, request_seed(request), request.request_id
        )
        try:
            wire.Sampling.of(sampling.document())  # refuse here what the last stage would
        except wire.WireError as error:
            raise EngineError(f"request {request.request_id}: {error}") from None
        self._ensure_connected()
        stage = self.stage
        number = self._take_request_number()
        cache = stage.make_cache()
        prompt = mx.array(request.prompt_tokens, dtype=mx.uint32)
        step = 0
        finished_cleanly = False
        try:
            self._send(wire.document_frame(Kind.BEGIN, number, 0, sampling.document()))
            # As mlx-lm's generate_step: all but the last prompt token fill the caches in
            # chunks; the last token alone produces the first sampled token.
            body = prompt[:-1]
            for start in range(0, body.size, self.prefill_chunk):
                step += 1
                self._forward(number, step, body[start : start + self.prefill_chunk], cache, False)
            chunks_in_flight = step
            last = prompt[-1:]
            while True:
                step += 1
                self._forward(number, step, last, cache, True)
                waited = self.token_timeout_s * (1 + chunks_in_flight)
                chunks_in_flight = 0
                token = self._receive(waited, number, step, (Kind.TOKEN,)).token()
                finished_cleanly = True
                yield token
                finished_cleanly = False
                last = mx.array([token], dtype=mx.uint32)
        except ChannelError as error:
            raise self._lost(f"at step {step} of request {request.request_id}", error) from error
        except Exception as error:  # the stages are mid-request: this chain is unusable now
            self._lost(f"at step {step} of request {request.request_id}", ChannelError(str(error)))
            raise
        finally:
            # finished_cleanly: closed at a yield (EOS, max_tokens, stop, cancel); no frame is
            # in flight, so END frees every stage's KV cache and the chain stays usable.
            if finished_cleanly and self._healthy:
                try:
                    self._send(wire.Frame(Kind.END, number, step + 1))
                except ChannelError as error:
                    self._lost(f"ending request {request.request_id}", error)

    def _forward(self, number: int, step: int, tokens: mx.array, cache: list, sample: bool) -> None:
        """Embed and run stage 0 over `tokens` (L,), then seal the (1, L, D) result downstream."""
        hidden = self.stage.forward(self.stage.embed(tokens[None]), cache)  # (1, L, D)
        mx.eval(hidden)
        self._send(wire.hidden_frame(number, step, hidden, sample))

    # -- the hops ----------------------------------------------------------------------------

    def _send(self, frame: wire.Frame) -> None:
        outbound = self._outbound
        if outbound is None:
            raise ChannelError(self._abort_reason or "the pipeline is not connected")
        wire.send(outbound, frame, self.layers)

    def _receive(
        self, timeout_s: float, request: int, step: int, kinds: tuple[Kind, ...]
    ) -> wire.Frame:
        inbound = self._inbound
        if inbound is None:
            raise ChannelError(self._abort_reason or "the pipeline is not connected")
        return wire.receive(inbound, timeout_s, request, self._last_layers, step, kinds)

    def _take_request_number(self) -> int:
        number = self._next_request
        self._next_request += 1
        return number

    def _ensure_connected(self) -> None:
        if self._outbound is None or self._inbound is None or not self._healthy:
            log.info("pipeline not connected (%s); reconnecting", self._failure or "new")
            self.connect()

    def _accept_last_stage(self, outbound_sock: socket.socket, deadline: float) -> Any:
        """Accept the last stage's connection; unauthenticated callers are turned away."""
        self.open_return_listener()
        listener = self._listener
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChannelError(
                    f"the last stage did not connect back to "
                    f"{self.return_listen_host}:{listener.getsockname()[1]} within "
                    f"{self.connect_timeout_s} s"
                )
            readable, _, _ = select.select([listener, outbound_sock], [], [], min(remaining, 1.0))
            if outbound_sock in readable:
                raise ChannelError("stage 1 closed the connection while the chain was forming")
            if listener not in readable:
                continue
            sock, address = listener.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                return self._channel_class.server(
                    sock, self._cluster_key, PURPOSE, max(deadline - time.monotonic(), 0.1)
                )
            except ChannelError as error:
                log.warning("turned away a return connection from %s:%s: %s", *address[:2], error)

    def _setup(self, deadline: float) -> None:
        """SETUP roll call: each stage checks it continues the previous one and reports."""
        self._next_request = 1
        setup = wire.document_frame(Kind.SETUP, 0, 0, {"reports": [self._local_report(0)]})
        wire.send(self._outbound, setup, wire.SETUP_SENDER)
        # Request 0 is bound to SETUP_SENDER both ways: nobody knows the ranges before it.
        timeout = max(deadline - time.monotonic(), 0.1)
        ready = wire.receive(self._inbound, timeout, 0, wire.SETUP_SENDER, 0, (Kind.READY,))
        self._reports = self._check_reports(ready.document().get("reports"))
        self._last_layers = range(*self._reports[-1]["layers"])

    def _check_reports(self, reports: Any) -> list[dict[str, Any]]:
        """The READY roll call must list contiguous stages covering the model, as planned."""
        expected = 1 + len(self.stages)
        if not isinstance(reports, list) or len(reports) != expected:
            count = len(reports) if isinstance(reports, list) else 0
            raise ChannelError(f"the roll call came back with {count} stages, expected {expected}")
        problems = []
        next_start = 0
        for index, report in enumerate(reports):
            layers = report.get("layers") if isinstance(report, dict) else None
            if not (isinstance(layers, list) and len(layers) == 2):
                raise ChannelError(f"stage {index} sent a malformed roll call report")
            start, stop = layers
            if "problem" in report:
                problems.append(f"stage {index}: {report['problem']}")
            if start != next_start:
                problems.append(f"stage {index} starts at layer {start}, expected {next_start}")
            planned = self.stages[index - 1].layers if index else None
            if planned is not None and planned != range(start, stop):
                problems.append(
                    f"stage {index} serves [{start}, {stop}), the plan says "
                    f"[{planned.start}, {planned.stop})"
                )
            next_start = stop
        if next_start != self.stage.total_layers:
            total = self.stage.total_layers
            problems.append(f"the stages end at layer {next_start}, the model has {total}")
        if problems:
            raise EngineError("the pipeline stages do not form the model: " + "; ".join(problems))
        return reports

    def _local_report(self, active: int) -> dict[str, Any]:
        return {
            "layers": [self.layers.start, self.layers.stop],
            "peak_memory_bytes": self.stage.peak_memory_bytes,
            "active_requests": active,
        }

    # -- failure -----------------------------------------------------------------------------

    def _lost(self, context: str, error: ChannelError) -> EngineError:
        """Mark the chain broken, close it, and describe why (the abort reason wins)."""
        aborted = self._abort_reason
        self._fail(f"aborted: {aborted}" if aborted else str(error))
        self._close_channels()
        if aborted:
            return EngineError(f"pipeline request aborted {context}: {aborted}")
        return EngineError(f"pipeline stage lost {context}: {error}")

    def _fail(self, reason: str) -> None:
        if self._healthy:
            log.error("pipeline marked unhealthy: %s", reason)
        self._healthy = False
        self._failure = reason

    def _close_channels(self) -> None:
        for channel in (self._outbound, self._inbound):
            if channel is not None:
                channel.close()
        self._outbound = self._inbound = None
