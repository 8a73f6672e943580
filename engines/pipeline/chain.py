"""One pipeline session's sealed hops: connect to stage 1, accept the last stage, roll call."""

from __future__ import annotations

import logging
import queue
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from discovery.framing import connect, wait_readable
from discovery.handshake_gate import HandshakeGate
from engines.pipeline import wire
from engines.pipeline.wire import PURPOSE, Kind
from errors import ChannelError, EngineError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Chain:
    """The hop to stage 1, the hop back from the last stage, and the SETUP roll call reports."""

    outbound: Any
    inbound: Any
    reports: list[dict[str, Any]]

    @property
    def last_layers(self) -> range:
        return range(*self.reports[-1]["layers"])

    def close(self) -> None:
        self.outbound.close()
        self.inbound.close()


def open_chain(
    first: tuple[str, int],
    listener: socket.socket,
    cluster_key: bytes,
    own_report: dict[str, Any],
    planned: Sequence[range | None],
    total_layers: int,
    timeout_s: float,
    channel_class: Any,
) -> Chain:
    """Build the chain with fresh session keys and check the roll call against the plan.

    Raises ChannelError when a hop cannot be built in `timeout_s`, EngineError when the stages
    do not form the model as planned (`planned`: each remote stage's expected layers, or None).
    """
    deadline = time.monotonic() + timeout_s
    sock = connect(first[0], first[1], timeout_s)
    outbound = channel_class.client(sock, cluster_key, PURPOSE, timeout_s)
    inbound = None
    try:
        inbound = _accept_last_stage(listener, sock, cluster_key, deadline, channel_class)
        setup = wire.document_frame(Kind.SETUP, 0, {"reports": [own_report]})
        wire.send(outbound, setup, wire.SETUP_SENDER)
        # Frame 0 is bound to SETUP_SENDER both ways: nobody knows the ranges before it.
        ready_expected = wire.Frame(Kind.READY, 0)
        timeout = max(deadline - time.monotonic(), 0.1)
        ready = wire.receive_answer(inbound, timeout, ready_expected, wire.SETUP_SENDER)
        reports = check_reports(ready.document().get("reports"), planned, total_layers)
    except BaseException:
        outbound.close()
        if inbound is not None:
            inbound.close()
        raise
    return Chain(outbound, inbound, reports)


def _accept_last_stage(
    listener: socket.socket,
    outbound_sock: socket.socket,
    cluster_key: bytes,
    deadline: float,
    channel_class: Any,
) -> Any:
    """The last stage's proven connection back; strangers are turned away off this thread."""
    proven: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def prove(sock: socket.socket, deadline_s: float) -> Any:
        return channel_class.server(sock, cluster_key, PURPOSE, deadline_s)

    gate = HandshakeGate(listener, prove, lambda channel, _: proven.put(channel), "return hop")
    gate.start()
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                host, port = listener.getsockname()[:2]
                raise ChannelError(f"the last stage did not connect back to {host}:{port} in time")
            if wait_readable(outbound_sock, 0):
                raise ChannelError("stage 1 closed the connection while the chain was forming")
            try:
                return proven.get(timeout=min(remaining, 0.1))
            except queue.Empty:
                continue
    finally:
        gate.stop()
        while not proven.empty():  # proven too late, or more than one: not ours to keep
            proven.get_nowait().close()


def check_reports(
    reports: Any, planned: Sequence[range | None], total_layers: int
) -> list[dict[str, Any]]:
    """The READY roll call must list contiguous stages covering the model, as planned."""
    expected = 1 + len(planned)
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
        plan = planned[index - 1] if index else None
        if plan is not None and plan != range(start, stop):
            problems.append(
                f"stage {index} serves [{start}, {stop}), the plan says [{plan.start}, {plan.stop})"
            )
        next_start = stop
    if next_start != total_layers:
        problems.append(f"the stages end at layer {next_start}, the model has {total_layers}")
    if problems:
        raise EngineError("the pipeline stages do not form the model: " + "; ".join(problems))
    return reports
