"""The engine core in a process of its own, beside the API process (as vLLM V1 splits them).

The API process keeps HTTP, the dialects, tokenizing and detokenizing, streaming, logs and
metrics; the engine-core process (engines/core/core_main.py) holds the scheduler and the
model — the single engine, tp rank 0 or pipeline stage 0 — so the model's steps never wait
for the API's interpreter, and the API turns step n's tokens into text while the core runs
step n+1.

The channel is the child's stdin and stdout carrying msgpack: one peer on one machine needs
no broker, routing or reconnection (what pyzmq adds), and msgpack's streaming unpacker does
the framing. In: the spec first, then `add` (the request's document), `abort`, `evict`,
`engine_abort`, `close`. Out: `ready` or `failed`, one `step` message per engine step with
every token of the batch (not one per token), and a `status` heartbeat.

Supervised like a worker: a core that exits, or sends nothing for `lost_after_s` (frozen:
it is then killed), ends every request with an error at once and reads unhealthy, so the
cluster supervisor re-plans and starts a new one. The core exits when its stdin closes, so
a killed serve leaves no orphan.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import IO, Any

import msgpack

from discovery.json_child import JsonChild
from engines.core.engine import EngineInfo, StepOutput
from engines.core.engine_spec import EngineSpec, resolve
from engines.core.request import GenerationRequest
from engines.core.scheduler import Release, StepReport
from errors import EngineError

log = logging.getLogger(__name__)

PROCESS_CORE = "process"  # --engine-core: the engine core in a process of its own (the default)
THREAD_CORE = "thread"  # ... or on a thread of the API process
STATUS_INTERVAL_S = 0.5  # the core's heartbeat, with its health, info and memory
CLOSE_GRACE_S = 10.0  # a closing core finishes its step and closes its engine within this
READ_CHUNK = 1 << 16


class MsgpackChild(JsonChild):
    """A JsonChild whose stdin and stdout carry msgpack instead of JSON lines."""

    def _encode(self, message: dict[str, Any]) -> bytes:
        return pack(message)

    def _decode(self, stream: IO[bytes]) -> Iterator[Any]:
        return unpack_stream(stream)


def pack(message: Any) -> bytes:
    return msgpack.packb(message, use_bin_type=True, default=_plain)


def unpack_stream(stream: IO[bytes]) -> Iterator[Any]:
    """Every message on `stream` until EOF, as soon as its bytes arrive."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    while chunk := stream.read1(READ_CHUNK):  # type: ignore[attr-defined]
        unpacker.feed(chunk)
        yield from unpacker


def _plain(value: Any) -> Any:
    """What msgpack cannot carry itself: sets, ranges, paths and the like."""
    if isinstance(value, set | frozenset | range):
        return list(value)
    return str(value)


# -- step reports on the wire ---------------------------------------------------------------


# A report crosses as its fields by name, and each output and release as a row: the tuple of
# its dataclass's fields in their order, so a token costs its values, not their names. Both
# ends follow the dataclasses: a field added to StepReport, StepOutput or Release crosses too.
_REPORT_FIELDS = tuple(field.name for field in fields(StepReport))
_ROW_TYPES: dict[str, type[Any]] = {"outputs": StepOutput, "ended": Release}
# attrgetter rather than astuple, which deep-copies every value (step_times too) every step
_ROW_OF = {
    name: attrgetter(*(field.name for field in fields(kind))) for name, kind in _ROW_TYPES.items()
}


def report_document(report: StepReport) -> dict[str, Any]:
    document: dict[str, Any] = {"k": "step"}
    for name in _REPORT_FIELDS:
        value, row_of = getattr(report, name), _ROW_OF.get(name)
        document[name] = [row_of(entry) for entry in value] if row_of else value
    return document


def report_of(message: dict[str, Any]) -> StepReport:
    values: dict[str, Any] = {}
    for name in _REPORT_FIELDS:
        value, kind = message[name], _ROW_TYPES.get(name)
        if kind is not None:
            value = [kind(*map(_tupled, row)) for row in value]
        elif isinstance(value, list):  # admitted: (uid, cached, when) each
            value = [_tupled(entry) for entry in value]
        values[name] = value
    return StepReport(**values)


def _tupled(value: Any) -> Any:
    """A value as it was sent: msgpack reads every tuple back as a list (top_logprobs' pairs)."""
    return tuple(map(_tupled, value)) if isinstance(value, list) else value


def info_document(info: EngineInfo) -> dict[str, Any]:
    return {"strategy": info.strategy, "world_size": info.world_size, "detail": info.detail}


# -- the API side ---------------------------------------------------------------------------


# -- starting a core ahead of its spec ------------------------------------------------------


class _Relay:
    """A child's callbacks, bound to the CoreProcess that adopts it (a spare has none yet)."""

    def __init__(self) -> None:
        self._on_message: Any = None
        self._on_exit: Any = None
        self.exited: int | None = None

    def attach(self, on_message: Any, on_exit: Any) -> None:
        self._on_message, self._on_exit = on_message, on_exit
        if self.exited is not None:
            on_exit(self.exited)

    def message(self, message: dict[str, Any]) -> None:
        if self._on_message is not None:
            self._on_message(message)

    def exit(self, code: int) -> None:
        self.exited = code
        if self._on_exit is not None:
            self._on_exit(code)


@dataclass
class _Launch:
    """A started core process waiting for its spec, and the socket that hands it
    descriptors (the child's end has `child_descriptors` as its number there)."""

    child: MsgpackChild
    relay: _Relay
    descriptors: socket.socket
    child_descriptors: int


_spare: _Launch | None = None
_spare_lock = threading.Lock()


def _spawn() -> _Launch:
    relay = _Relay()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    number = theirs.fileno()  # the same in the child (pass_fds keeps numbers)
    child = MsgpackChild(
        [sys.executable, "-m", "engines.core.core_main"],
        name="engine-core",
        own_group=True,  # stopping it reaches tp rank 0, its own child
        keep_messages=False,
        on_message=relay.message,
        on_exit=relay.exit,
        pass_fds=(number,),
    )
    try:
        child.start(None)
    except OSError as error:
        ours.close()
        raise EngineError(f"cannot start the engine core: {error}") from error
    finally:
        theirs.close()
    return _Launch(child, relay, ours, number)


def prewarm() -> None:
    """Start a core process now, so the first plan's core has Python and mlx-lm loaded by
    the time its spec is ready (serve calls this before discovering and planning)."""
    global _spare
    with _spare_lock:
        if _spare is None:
            try:
                _spare = _spawn()
            except EngineError as error:
                log.warning("no spare engine core: %s", error)


def take_spare() -> _Launch | None:
    global _spare
    with _spare_lock:
        launch, _spare = _spare, None
    if launch is not None and launch.child.poll() is not None:
        launch.descriptors.close()
        return None
    return launch


def discard_spare() -> None:
    """Stop a spare nobody took (a plan that was refused, serve shutting down)."""
    launch = take_spare()
    if launch is not None:
        launch.descriptors.close()
        launch.child.stop(CLOSE_GRACE_S, ask=launch.child.close_stdin)


class CoreView:
    """`runner.engine` for a core in another process: what it last said of itself."""

    def __init__(self, tokenizer: Any, model_path: str, send: Any) -> None:
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.features: frozenset[str] = frozenset()
        self.eos_token_ids: set[int] = set(tokenizer.eos_token_ids)
        self._refusal: Any = None
        self._info = EngineInfo(strategy="starting")
        self._healthy = True
        self.memory: dict[str, int] = {}
        self._send = send  # to the core, quietly (nothing when it is gone)

    def ready(self, message: dict[str, Any]) -> None:
        self.features = frozenset(message["features"])
        self.eos_token_ids = set(message["eos"])
        self._refusal = resolve(message["refusal"]) if message.get("refusal") else None
        self.status(message)

    def status(self, message: dict[str, Any]) -> None:
        info = message["info"]
        self._info = EngineInfo(info["strategy"], info["world_size"], info["detail"])
        self._healthy = self._healthy and bool(message["healthy"])
        self.memory = message["memory"]

    def stepped(self, message: dict[str, Any]) -> None:
        """A step report's health, and its info when it has one."""
        self._healthy = self._healthy and bool(message.get("h", True))
        if "i" in message:
            info = message["i"]
            self._info = EngineInfo(info["strategy"], info["world_size"], info["detail"])

    def lost(self) -> None:
        self._healthy = False

    def info(self) -> EngineInfo:
        return self._info

    def healthy(self) -> bool:
        return self._healthy

    def refusal(self, request: GenerationRequest) -> str | None:
        return self._refusal(request) if self._refusal is not None else None

    def memory_held(self) -> dict[str, int]:
        return {kind: self.memory.get(kind, 0) for kind in ("weights", "prefix_cache")}

    def abort(self, reason: str) -> None:
        """Make a step blocked on a remote worker return at once (any thread)."""
        self._send({"k": "engine_abort", "reason": reason})

    def close(self) -> None:
        """The process is closed by its CoreProcess."""


class CoreProcess:
    """An EngineCore (engines/core/runner.py) whose scheduler and engine run in a child."""

    def __init__(self, spec: EngineSpec, max_batch: int, lost_after_s: float = 5.0) -> None:
        self.spec = spec
        self.max_batch = max_batch
        self.lost_after_s = lost_after_s
        self.engine: CoreView | None = None
        self._child: MsgpackChild | None = None
        self._listener: Any = None
        self._ready = threading.Event()
        self._ready_message: dict[str, Any] | None = None
        self._last_heard = time.monotonic()
        self._closing = threading.Event()
        self._lost_reason: str | None = None
        self._watchdog: threading.Thread | None = None

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer if self.engine is not None else None

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, listener: Any, load_timeout_s: float | None) -> None:
        """Hand the spec to a core (the spare one, if serve started it ahead), load the
        tokenizer here meanwhile, and wait for the core's engine."""
        from engines.model.tokenizer_loading import load_serving_tokenizer

        self._listener = listener
        launch = take_spare() or _spawn()
        self._child = launch.child
        launch.relay.attach(self._on_message, self._on_exit)
        inherited = self.spec.listener
        first = {
            "spec": self.spec.document(),
            "max_batch": self.max_batch,
            "descriptors": launch.child_descriptors,
            "listener": inherited is not None,
            "status_interval_s": STATUS_INTERVAL_S,
        }
        try:
            self._child.send(first)
            if inherited is not None:  # the pipeline's bound return socket, as a descriptor
                socket.send_fds(launch.descriptors, [b"listener"], [inherited.fileno()])
        except (OSError, ValueError) as error:
            raise EngineError(f"cannot start the engine core: {error}") from error
        finally:
            launch.descriptors.close()
            if inherited is not None:
                inherited.close()  # the core holds it now
        try:
            tokenizer = load_serving_tokenizer(self.spec.arguments["model_path"])
        except (OSError, ValueError) as error:
            raise EngineError(f"cannot load the tokenizer: {error}") from error
        self.engine = CoreView(tokenizer, self.spec.arguments["model_path"], self._send_quietly)
        self._wait_ready(load_timeout_s)
        self._watchdog = threading.Thread(target=self._watch, name="engine-core watch", daemon=True)
        self._watchdog.start()

    def _wait_ready(self, timeout_s: float | None) -> None:
        assert self._child is not None and self.engine is not None
        if not self._ready.wait(timeout_s):
            raise EngineError(f"the engine core did not load within {timeout_s} s")
        message = self._ready_message
        if message is None or message.get("k") != "ready":
            reason = (message or {}).get("reason") or f"it {self._child.exit_description()}"
            raise EngineError(f"the engine core failed to load: {reason}")
        self.engine.ready(message)
        self._last_heard = time.monotonic()
        log.info("engine core ready (pid %s): %s", self._child.pid, self.engine.info().strategy)

    def close(self) -> None:
        """Ask the core to finish and close its engine; kill it past CLOSE_GRACE_S."""
        self._closing.set()
        child = self._child
        if child is None:
            return
        child.stop(CLOSE_GRACE_S, ask=lambda: self._send_quietly({"k": "close"}))

    # -- requests ----------------------------------------------------------------------------

    def add(self, uid: int, request: GenerationRequest) -> None:
        self._send({"k": "add", "uid": uid, "r": request.document()})

    def abort(self, uids: list[int]) -> None:
        self._send({"k": "abort", "uids": uids})

    def evict(self, keep_fraction: float) -> None:
        self._send({"k": "evict", "keep": keep_fraction})

    def memory_accounting(self) -> dict[str, dict[str, int]]:
        from engines.observability.process_memory import process_memory

        core = dict(self.engine.memory) if self.engine is not None else {}
        return {"api": process_memory(None), "engine_core": core}

    def _send(self, message: dict[str, Any]) -> None:
        if self._child is None or self._lost_reason is not None:
            raise EngineError(f"the engine core is gone: {self._lost_reason or 'not started'}")
        try:
            self._child.send(message)
        except (OSError, ValueError) as error:
            raise EngineError(f"the engine core is gone: {error}") from error

    def _send_quietly(self, message: dict[str, Any]) -> None:
        try:
            self._send(message)
        except EngineError:
            pass

    # -- what the core says (the child's reader thread) --------------------------------------

    def _on_message(self, message: dict[str, Any]) -> None:
        self._last_heard = time.monotonic()
        kind = message.get("k")
        if kind == "step":
            if self.engine is not None:
                self.engine.stepped(message)
            self._listener.on_report(report_of(message))
        elif kind == "loading":  # the engine's layers, to serve's progress bar
            from engines.observability import load_progress

            load_progress.report(int(message["done"]), int(message["total"]))
        elif kind == "status":
            if self.engine is not None and self._ready.is_set():
                self.engine.status(message)
            self._listener.on_report(StepReport())  # deadlines, when no step reports come
        elif kind in ("ready", "failed"):
            self._ready_message = message
            self._ready.set()

    def _on_exit(self, code: int) -> None:
        self._ready.set()  # a core that died loading is not ready
        if self._closing.is_set():
            return
        reason = self._lost_reason or f"the engine core exited (code {code})"
        self._lost(reason)

    def _lost(self, reason: str) -> None:
        if self._lost_reason is None:
            self._lost_reason = reason
        log.error("%s", reason)
        if self.engine is not None:
            self.engine.lost()
        if self._ready.is_set() and self._listener is not None:
            self._listener.on_lost(reason)

    def _watch(self) -> None:
        """A core that says nothing for lost_after_s is frozen: kill it (its exit reports)."""
        while not self._closing.wait(STATUS_INTERVAL_S / 2):
            child = self._child
            if child is None or child.poll() is not None:
                return
            silent = time.monotonic() - self._last_heard
            if silent > self.lost_after_s:
                self._lost_reason = (
                    f"the engine core stopped answering for {silent:.1f} s; killed it"
                )
                child.kill()
                return
