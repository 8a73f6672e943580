"""The engine-core process: `python -m engines.core.core_main`, started by CoreProcess.

stdin: msgpack messages — first {"spec", "max_batch", "descriptors", "listener",
"status_interval_s"} (a pipeline's bound socket comes over the `descriptors` socket),
then add / abort / evict / engine_abort / close; EOF means the API process is gone.
stdout (the protocol's own descriptor): ready or failed, step reports, status heartbeats.
stderr: the log. See engines/core/core_process.py for the whole exchange.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from typing import Any

from discovery.json_child import configure_child_logging
from engines.core.core_process import info_document, pack, report_document, unpack_stream
from engines.core.engine import Engine
from engines.core.engine_spec import EngineSpec
from engines.core.request import GenerationRequest
from engines.core.scheduler import BatchScheduler, StepReport
from engines.observability import load_progress
from errors import RequestError

log = logging.getLogger("engines.core.core_main")

EXIT_GRACE_S = 15.0  # closing past this means a stuck engine: leave without it


class Output:
    """fd 1 kept for protocol messages, written whole under a lock; anything else printed
    (a library's warning) goes to stderr instead."""

    def __init__(self) -> None:
        fd = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        self._stream = os.fdopen(fd, "wb")
        self._lock = threading.Lock()

    def write(self, message: dict[str, Any]) -> None:
        data = pack(message)
        with self._lock:
            self._stream.write(data)
            self._stream.flush()


def main() -> int:
    configure_child_logging("engine-core[%(process)d]")
    output = Output()
    import mlx_lm  # noqa: F401 (the second or two a spare core spends before its spec comes)

    messages = unpack_stream(sys.stdin.buffer)
    first = next(messages, None)
    if not isinstance(first, dict):
        return 0  # the API process went away before saying anything (a spare nobody took)
    try:
        spec = EngineSpec.from_document(first["spec"])
        listener = _inherited_listener(first)
        engine = spec.build(listener)
        scheduler = BatchScheduler(engine, int(first["max_batch"]), _reporter(output, engine))
        with load_progress.listening(lambda done, total: output.write(_loaded(done, total))):
            scheduler.start()
    except BaseException as error:  # noqa: BLE001 (every load failure goes to the parent)
        log.exception("the engine failed to load")
        output.write({"k": "failed", "reason": str(error) or type(error).__name__})
        return 1
    output.write({**_status(engine), **_capabilities(engine), "k": "ready"})
    log.info("engine core ready: %s", engine.info().strategy)
    stop = threading.Event()
    heartbeat = threading.Thread(
        target=_heartbeat,
        args=(engine, output, float(first["status_interval_s"]), stop),
        name="heartbeat",
        daemon=True,
    )
    heartbeat.start()
    _serve(messages, scheduler, engine)
    stop.set()
    deadline = threading.Timer(EXIT_GRACE_S, os._exit, args=(1,))  # a close that hangs
    deadline.daemon = True
    deadline.start()
    scheduler.close()
    return 0


def _inherited_listener(first: dict[str, Any]) -> socket.socket | None:
    """The bound socket the spec's engine takes over (a pipeline's return hop), received
    over the descriptor socket; None when it has none."""
    with socket.socket(fileno=int(first["descriptors"])) as channel:
        if not first.get("listener"):
            return None
        _, descriptors, _, _ = socket.recv_fds(channel, 64, 1)
    if not descriptors:
        raise OSError("the API process sent no listening socket")
    return socket.socket(fileno=descriptors[0])


def _serve(messages: Any, scheduler: BatchScheduler, engine: Engine) -> None:
    """Apply commands until `close` or EOF (the API process is gone)."""
    for message in messages:
        kind = message.get("k") if isinstance(message, dict) else None
        if kind == "add":
            try:
                request = GenerationRequest.from_document(message["r"])
            except RequestError as error:  # the API checked it: this is a bug, not input
                log.error("refusing request %s: %s", message.get("uid"), error)
                continue
            scheduler.add(int(message["uid"]), request)
        elif kind == "abort":
            scheduler.abort([int(uid) for uid in message["uids"]])
        elif kind == "evict":
            scheduler.evict(float(message["keep"]))
        elif kind == "engine_abort":
            engine.abort(str(message["reason"]))
        elif kind == "close":
            return
        else:
            log.warning("unknown message %r", kind)


def _reporter(output: Output, engine: Engine) -> Any:
    def send(report: StepReport) -> None:
        if not report:  # an empty step: the heartbeat carries the deadline checks
            return
        # Health rides on every report, and the engine's info on one that let sequences go,
        # so the API process never reads them older than the events it streams.
        document = report_document(report) | {"h": engine.healthy()}
        if report.ended:
            document["i"] = info_document(engine.info())
        output.write(document)

    return send


def _loaded(done: int, total: int) -> dict[str, Any]:
    return {"k": "loading", "done": done, "total": total}


def _capabilities(engine: Engine) -> dict[str, Any]:
    return {
        "features": sorted(engine.features),
        "eos": sorted(engine.eos_token_ids),
        "refusal": engine.refusal_function,
    }


def _status(engine: Engine) -> dict[str, Any]:
    from engines.observability.process_memory import process_memory

    return {
        "k": "status",
        "healthy": engine.healthy(),
        "info": info_document(engine.info()),
        "memory": process_memory(engine),
    }


def _heartbeat(engine: Engine, output: Output, interval_s: float, stop: threading.Event) -> None:
    while not stop.wait(interval_s):
        try:
            output.write(_status(engine))
        except OSError:  # the API process is gone: stdin's EOF ends the main loop
            return
        except Exception:  # a status that fails to build must not stop the heartbeat
            log.exception("could not report the engine's status")


def leave(code: int) -> None:
    """Exit once everything is closed, as serve and join do (cli/main.py): after the other
    threads, without the interpreter's teardown, in which a garbage-collected mlx object can
    destroy a native thread still joinable and abort the process (exit -6, "terminate called
    without an active exception", after a clean close)."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(EXIT_GRACE_S)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
