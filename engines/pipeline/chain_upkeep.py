"""Keeping the engine's sealed chain: open it (a fresh session and roll call, every session
counter reset), number and send the frames down it, run a STATUS roll call, and when a hop
fails, mark the chain lost, drop the batch and name every stage the frame had to pass.
Opening the hops themselves is chain.py's; this is what the engine does around them.
"""

from __future__ import annotations

import logging
from typing import Any

from engines.pipeline import wire
from engines.pipeline.batches import StageBatches
from engines.pipeline.chain import open_chain
from engines.pipeline.frame_clock import FrameClock
from engines.pipeline.wire import Kind
from errors import ChannelError, EngineError

log = logging.getLogger(__name__)


class ChainUpkeep:
    """Part of EncryptedPipelineEngine (engine.py), which owns the state these methods use:
    its `stages`, the return `_listener`, the `_chain` and whether it is `_healthy`, the
    frame `_number`, the `_schedule` and the answers `_awaiting`."""

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
        if self._local is not None:  # the old session's entries (the disk tier's files stay)
            self._local.prefix.close()
        self._local = StageBatches(self.stage, self._disk)
        self._clock = FrameClock(self._chain.outbound, self._chain.inbound)
        self._forget_prefix_cache()
        self._schedule.restart()
        self._awaiting.clear()
        self._number = 0
        self._healthy, self._failure = True, None
        if self._disk is not None:
            try:
                self._relist_disk_entries()
            except ChannelError as error:
                raise self._lost("listing the disk tier's entries", error) from error
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
            "prefix_entries": len(self._local.prefix) if self._local is not None else 0,
            "prefix_bytes": self._local.prefix.nbytes if self._local is not None else 0,
            "prefilled_tokens": self._local.prefilled_tokens if self._local is not None else 0,
        }

    def _lost(self, context: str, error: ChannelError) -> EngineError:
        """Mark the chain broken, close it, drop the batch, and say why (abort reason first)."""
        aborted = self._abort_reason
        self._fail(f"aborted: {aborted}" if aborted else str(error))
        self._close_chain()
        lost = self._schedule.active
        self._schedule.clear()
        self._sampling.clear()
        self.speculation.clear()
        self.books.clear_waiters()
        self._forget_prefix_cache()  # the sequences are gone, and with the stages every entry
        self._awaiting.clear()
        if aborted:
            return EngineError(f"pipeline aborted {context} ({lost} sequences): {aborted}")
        # Any stage may be the one that stopped: name every one the frame had to pass.
        chain = ", ".join(stage.describe(index) for index, stage in enumerate(self.stages, 1))
        return EngineError(
            f"pipeline stage lost {context} ({lost} sequences): {error}; the chain after "
            f"stage 0: {chain}"
        )

    def _fail(self, reason: str) -> None:
        if self._healthy:
            log.error("pipeline marked unhealthy: %s", reason)
        self._healthy = False
        self._failure = reason

    def _close_chain(self) -> None:
        chain, self._chain = self._chain, None
        if chain is not None:
            chain.close()
