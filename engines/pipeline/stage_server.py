"""A stage's server: accept the previous hop, connect the next, run sealed frames through it."""

from __future__ import annotations

import logging
import os
import queue
import select
import socket
import time
from typing import Any

import mlx.core as mx

from discovery.framing import connect
from discovery.handshake_gate import HandshakeGate
from discovery.secure_channel import SecureChannel
from engines.core.request import GenerationRequest
from engines.decoding.grammar import GrammarCompiler
from engines.decoding.sampling import (
    draw_each,
    give_back_draws,
    make_request_sampler,
    token_logprobs,
)
from engines.pipeline import sequence_documents, wire
from engines.pipeline.chain_disk import ChainDiskTier, SessionDisk
from engines.pipeline.stage_model import StageModel
from engines.pipeline.stage_session import _Scoring, _Session, scores
from engines.pipeline.stage_spec import StageSpec
from engines.pipeline.wire import PURPOSE, Kind, WireError
from errors import ChannelError, EngineError

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # how often an idle server notices stop() from another thread
CONNECT_RETRY_S = 0.1
MAX_CONNECT_WAIT_S = 5.0


class EncryptedPipelineServer:
    """Serves one stage: accept the previous hop, connect the next, run frames until it ends.

    `channel_class` exists only so the benchmark can measure the cost of sealing; everything
    else uses SecureChannel. `grammars` (last stage) compiles the BEGIN grammars; without it a
    sequence with a grammar is refused. `disk`: this stage's prefix-cache disk tier; its files
    outlive sessions, each of which reopens it and adopts the files its coordinator names.
    """

    def __init__(
        self,
        spec: StageSpec,
        stage: StageModel,
        channel_class: Any = SecureChannel,
        grammars: GrammarCompiler | None = None,
        disk: ChainDiskTier | None = None,
    ):
        self.spec = spec
        self.stage = stage
        self.grammars = grammars
        self.disk = disk
        self._channel_class = channel_class
        self._listener: socket.socket | None = None
        # Proven inbound connections, handed over by the handshake gate's threads.
        self._proven: queue.SimpleQueue[tuple[Any, socket.socket, Any]] = queue.SimpleQueue()
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._stopping = False
        self.served_requests = 0  # sequences ended, over every session
        self.sessions = 0

    def bind(self) -> int:
        """Listen on the spec's host and port; returns the bound port."""
        listener = socket.create_server((self.spec.listen_host, self.spec.listen_port), backlog=8)
        self._listener = listener
        return listener.getsockname()[1]

    def stop(self) -> None:
        """Ask serve() to return (within IDLE_POLL_S when idle)."""
        self._stopping = True

    def serve(self, stop_fd: int | None = None) -> None:
        """Serve sessions until `stop_fd` reaches end of file or stop() is called."""
        if self._listener is None:
            self.bind()
        gate = HandshakeGate(
            self._listener, self._prove, self._hand_over, f"stage {self.spec.layers.start}"
        ).start()
        session: _Session | None = None
        try:
            while not self._stopping:
                watched: list[Any] = [self._wake_read, *(session.sockets() if session else [])]
                if stop_fd is not None:
                    watched.append(stop_fd)
                readable, _, _ = select.select(watched, [], [], IDLE_POLL_S)
                if stop_fd is not None and stop_fd in readable and not os.read(stop_fd, 4096):
                    log.info("stdin closed: the agent went away; exiting")
                    return
                if session is not None and not readable:
                    self._check_silence(session)
                if self._wake_read in readable:
                    fresh = self._open_proven()
                    if fresh is not None:
                        if session is not None:
                            log.info("a new session replaces the current one")
                            session.close()
                        session = fresh
                    continue
                if session is None or session.closed:
                    session = None
                    continue
                if session.outbound_sock in readable:
                    log.info("the next hop closed its connection; ending the session")
                    session.close()
                elif session.inbound_sock in readable:
                    if _at_end_of_stream(session.inbound_sock):
                        log.info("the previous hop closed the session")
                        session.close()
                    else:
                        self._serve_frame(session)
                if session.closed:
                    session = None
        finally:
            gate.stop()
            if session is not None:
                session.close()
            if self._listener is not None:
                self._listener.close()
            self._wake_read.close()
            self._wake_write.close()

    # -- sessions ----------------------------------------------------------------------------

    def _prove(self, sock: socket.socket, deadline_s: float) -> tuple[Any, socket.socket]:
        """A gate thread: the newcomer proves the cluster key, or is refused."""
        channel = self._channel_class.server(sock, self.spec.cluster_key, PURPOSE, deadline_s)
        return channel, sock

    def _hand_over(self, proven: tuple[Any, socket.socket], address: Any) -> None:
        """A gate thread: queue a proven connection and wake the serving loop."""
        inbound, sock = proven
        self._proven.put((inbound, sock, address))
        try:
            self._wake_write.send(b"!")
        except OSError:  # the server is shutting down; the queue dies with it
            inbound.close()

    def _open_proven(self) -> _Session | None:
        """The newest proven connection becomes a session (older ones are replaced anyway)."""
        try:
            self._wake_read.recv(4096)
        except BlockingIOError:
            pass
        fresh: _Session | None = None
        while True:
            try:
                inbound, sock, address = self._proven.get_nowait()
            except queue.Empty:
                return fresh
            if fresh is not None:
                fresh.close()
            fresh = self._open_session(inbound, sock, address)

    def _open_session(self, inbound: Any, sock: socket.socket, address: Any) -> _Session | None:
        """Connect to the next hop for a proven inbound connection."""
        timeout = self.spec.read_timeout_s
        try:
            outbound_sock = _connect_with_retry(
                self.spec.next_host, self.spec.next_port, min(timeout, MAX_CONNECT_WAIT_S)
            )
            outbound = self._channel_class.client(
                outbound_sock, self.spec.cluster_key, PURPOSE, timeout
            )
        except ChannelError as error:
            log.warning(
                "cannot reach the next hop %s:%d: %s",
                self.spec.next_host,
                self.spec.next_port,
                error,
            )
            inbound.close()
            return None
        self.sessions += 1
        log.info(
            "session %d: %s:%s -> this stage -> %s:%d",
            self.sessions,
            *address[:2],
            self.spec.next_host,
            self.spec.next_port,
        )
        return _Session(inbound, sock, outbound, outbound_sock, self.stage, self.disk)

    def _check_silence(self, session: _Session) -> None:
        """While sequences are active the coordinator keeps sending; silence means it is lost."""
        quiet = time.monotonic() - session.last_frame_at
        if session.batches.active and quiet > self.spec.read_timeout_s:
            log.warning(
                "rejecting the session: no frame arrived within %g s while %d sequences are active",
                self.spec.read_timeout_s,
                session.batches.active,
            )
            session.close()

    def _serve_frame(self, session: _Session) -> None:
        """Handle the next frame down the chain; any failure ends the session."""
        try:
            if session.previous is None:
                frame = wire.receive(
                    session.inbound, self.spec.read_timeout_s, 0, wire.SETUP_SENDER, (Kind.SETUP,)
                )
                self._roll_call(session, frame, setup=True)
            else:
                frame = wire.receive(
                    session.inbound,
                    self.spec.read_timeout_s,
                    session.next_number,
                    session.previous,
                    (Kind.BEGIN, Kind.HIDDEN, Kind.END, Kind.STATUS),
                )
                session.next_number += 1
                self._handle(session, frame)
            session.last_frame_at = time.monotonic()
        except ChannelError as error:  # includes WireError and timeouts
            log.warning("rejecting the session: %s", error)
            session.close()
        except Exception:  # a bug or an mlx failure must not kill the stage process
            log.exception("stage failure; closing the session")
            session.close()

    def _handle(self, session: _Session, frame: wire.Frame) -> None:
        me, last = self.stage.layers, self.spec.is_last
        if frame.kind is Kind.STATUS:
            self._roll_call(session, frame, setup=False)
        elif frame.kind is Kind.BEGIN:
            document = frame.document()
            request = sequence_documents.begin_request(document)
            row = frame.rows[0]
            session.batches.begin(
                row.uid, row.position, sequence_documents.prefix_entry_of(document)
            )
            if last:
                session.samplers[row.uid] = make_request_sampler(request)
                if scores(request):
                    session.scoring[row.uid] = self._scoring(row.uid, request)
            else:
                wire.send(session.outbound, frame, me)
            log.debug("sequence %d (%s) began", frame.rows[0].uid, request.request_id)
        elif frame.kind is Kind.END:
            orders = sequence_documents.EndOrders.of(frame)
            held = session.batches.active
            for uid, tokens in orders.keep:
                session.batches.keep(uid, tokens)
            for uid, entry, tokens in orders.share:  # prompts requests waited for
                session.batches.keep(uid, tokens, entry=entry)
            session.batches.end(frame.uids)
            session.batches.drop(orders.evict)
            session.batches.spill(orders.spill)
            self.served_requests += held - session.batches.active
            for uid in frame.uids:
                session.samplers.pop(uid, None)
                session.scoring.pop(uid, None)
            if not last:
                wire.send(session.outbound, frame, me)
        else:
            self._run_hidden(session, frame)

    def _scoring(self, uid: int, request: GenerationRequest) -> _Scoring:
        """A sequence's scoring; a grammar that does not compile refuses this sequence alone
        (its next TOKEN row says why) rather than the session."""
        if request.grammar is None:
            return _Scoring(request)
        if self.grammars is None:
            refusal = "this stage has no tokenizer to apply an output grammar with"
        else:
            try:
                return _Scoring(request, self.grammars.processor(request.grammar))
            except EngineError as error:
                refusal = str(error)[: wire.MAX_REFUSAL_CHARS]
        log.warning("sequence %d (%s) refused: %s", uid, request.request_id, refusal)
        return _Scoring(request, refusal=refusal)

    def _run_hidden(self, session: _Session, frame: wire.Frame) -> None:
        """Run a HIDDEN frame through this stage's layers; pass it on, or answer with tokens."""
        batches = session.batches
        started = time.perf_counter()
        batches.check_step(frame.group, frame.step)
        hidden = frame.tensor()  # (B, L, D)
        if hidden.shape[-1] != self.stage.hidden_size:
            raise WireError(
                f"activation width {hidden.shape[-1]} does not match the model's hidden size "
                f"{self.stage.hidden_size}"
            )
        if frame.is_prefill:
            hidden = batches.prefill(frame.rows[0], hidden)
        else:
            self._roll_back(session, frame)
            hidden = batches.decode(frame.group, frame.rows, hidden)
        number, group, step, rows = frame.number, frame.group, frame.step, frame.rows
        flags = frame.flags & (wire.LAST_CHUNK | wire.VERIFY)  # the answer's, as asked
        if not self.spec.is_last:
            mx.eval(hidden)
            session.meter.compute_s += time.perf_counter() - started
            times = (*frame.times, session.meter.entry())
            wire.send(
                session.outbound,
                wire.hidden_frame(number, group, step, rows, hidden, times, flags),
                self.stage.layers,
            )
            return
        if not frame.samples:  # nothing to sample: acknowledge once the caches hold the chunk
            mx.eval(batches.prefill_caches_of(rows[0].uid))
            tokens: list[int] = []
            scores = None
        elif frame.verifies:  # a lone sequence's next token and draft: a token per position
            tokens, scores = self._verify(session, rows[0].uid, hidden), None
        else:  # a decode step, or a prompt's last chunk: its last position's first token
            tokens, scores = self._sample(session, frame.uids, hidden[:, -1:, :])  # (B, 1, D)
        session.meter.compute_s += time.perf_counter() - started
        times = (*frame.times, session.meter.entry())
        answer = wire.token_frame(number, group, step, rows, tokens, times, scores, flags)
        wire.send(session.outbound, answer, self.stage.layers)

    def _roll_back(self, session: _Session, frame: wire.Frame) -> None:
        """Trim what a lone sequence's last verifying pass rejected; on the last stage, give
        back those positions' draws too, so each position keeps the draw of plain decoding."""
        for uid, rejected in session.batches.roll_back(frame.group, frame.rows).items():
            if self.spec.is_last:
                give_back_draws(session.samplers.get(uid), rejected)

    def _verify(self, session: _Session, uid: int, hidden: mx.array) -> list[int]:
        """Each position (1, L, D) sampled with the draw it has in plain decoding."""
        if uid in session.scoring:  # the coordinator never drafts for a scored sequence
            raise WireError(f"a verifying pass for sequence {uid}, which the last stage scores")
        logprobs = self.stage.logits(hidden[0][:, None, :])  # (L, V)
        return draw_each(session.samplers[uid], logprobs).tolist()

    def _sample(
        self, session: _Session, uids: list[int], hidden: mx.array
    ) -> tuple[list[int], list[Any] | None]:
        """Each row with its own sampler (one batched call when they share one: greedy), after
        its own logits processors; the logprobs of the rows that asked for them; a refused
        row's refusal instead (its token means nothing)."""
        scorings = [session.scoring.get(uid) for uid in uids]
        if any(scoring is not None and scoring.processes for scoring in scorings):
            logits = self.stage.logits(hidden, normalized=False)  # (B, V)
            rows = [
                logits[index : index + 1]
                if scoring is None or not scoring.processes
                else scoring.process(logits[index : index + 1])
                for index, scoring in enumerate(scorings)
            ]
            logits = mx.concatenate(rows, axis=0)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        else:
            logprobs = self.stage.logits(hidden)
        samplers = [session.samplers[uid] for uid in uids]
        if all(sampler is samplers[0] for sampler in samplers):
            sampled = samplers[0](logprobs)  # (B,)
        else:
            rows = [sampler(logprobs[index : index + 1]) for index, sampler in enumerate(samplers)]
            sampled = mx.concatenate(rows, axis=0)  # (B,)
        tokens = sampled.tolist()
        if all(scoring is None for scoring in scorings):
            return tokens, None
        scores: list[Any] = []
        for index, (token, scoring) in enumerate(zip(tokens, scorings, strict=True)):
            if scoring is None:
                scores.append(None)
                continue
            if scoring.refusal is not None:
                scores.append(scoring.refusal)
                continue
            scoring.sampled(token)
            if scoring.logprobs is None:
                scores.append(None)
            else:
                scores.append(token_logprobs(logprobs[index], token, scoring.logprobs))
        return tokens, scores

    def _roll_call(self, session: _Session, frame: wire.Frame, setup: bool) -> None:
        """SETUP or STATUS: append this stage's report and pass it on (the last one answers)."""
        reports = frame.document().get("reports")
        if not isinstance(reports, list) or not reports or len(reports) > 1024:
            raise WireError(f"{frame.kind.name} frame has no list of stage reports")
        if setup and self.disk is not None:  # the previous session closed it: writes are done
            session.disk = SessionDisk(self.disk)
        report: dict[str, Any] = {
            "layers": [self.stage.layers.start, self.stage.layers.stop],
            "peak_memory_bytes": self.stage.peak_memory_bytes,
            "active_requests": session.batches.active,
            "served_requests": self.served_requests,
            "prefix_entries": len(session.batches.prefix),
            "prefix_bytes": session.batches.prefix.nbytes,
            "prefilled_tokens": session.batches.prefilled_tokens,
        }
        loads = sequence_documents.load_orders_of(frame.document())
        if loads:  # prefix-cache entries on disk that sequences are about to begin from
            report["unreadable"] = session.batches.load(loads)
        disk_order = sequence_documents.disk_roll_call_of(frame.document())
        if disk_order is not None:  # a new session adopts the files a previous one left
            report["missing"] = _adopt(session, disk_order)
        if setup:
            previous = _report_layers(reports[-1])
            if previous.stop != self.stage.layers.start:
                report["problem"] = (
                    f"the previous stage ends at layer {previous.stop} but this stage starts "
                    f"at {self.stage.layers.start}"
                )
            session.previous = previous
            session.next_number = 1
        # Frame 0 (SETUP and its READY) binds SETUP_SENDER: no one knows the ranges before it.
        sender = wire.SETUP_SENDER if setup else self.stage.layers
        kind = Kind.READY if self.spec.is_last else frame.kind
        document = {"reports": [*reports, report]}
        wire.send(session.outbound, wire.document_frame(kind, frame.number, document), sender)


def _adopt(session: _Session, order: sequence_documents.DiskRollCall) -> list[int]:
    """The entries of a disk roll call whose files this stage lacks (all, without a tier)."""
    if session.disk is None:
        return [entry for entry, _ in order.adopt]
    return session.disk.adopt(order)


def _report_layers(report: Any) -> range:
    try:
        start, stop = report["layers"]
        # [0, 0): a relay's stage 0, which only embeds (stage_model.py)
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop):
            raise ValueError
    except (KeyError, TypeError, ValueError):
        raise WireError(f"malformed stage report in a roll call: {str(report)[:80]}") from None
    return range(start, stop)


def _at_end_of_stream(sock: socket.socket) -> bool:
    """True when a readable socket has nothing but end of stream (or an error) to give."""
    try:
        return not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def _connect_with_retry(host: str, port: int, wait_s: float) -> socket.socket:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return connect(host, port, timeout_s=max(deadline - time.monotonic(), 0.5))
        except ChannelError:
            if time.monotonic() + CONNECT_RETRY_S > deadline:
                raise
            time.sleep(CONNECT_RETRY_S)
