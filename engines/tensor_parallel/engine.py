"""TensorParallelEngine: the coordinator's side of a tp group, driving the rank-0 worker process."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from discovery.json_child import ChildNotReady, JsonChild
from engines.core.engine import Engine, EngineInfo, StepOutput
from engines.core.request import GenerationRequest
from engines.decoding.sampling import request_seed
from engines.model.tokenizer_loading import load_serving_tokenizer
from engines.observability.step_timing import StepTimes
from engines.prefix_cache.index import PrefixIndex
from engines.tensor_parallel.group import WorkerSpec
from engines.tensor_parallel.group_prefix_cache import GroupPrefixCache
from engines.tensor_parallel.step_clock import step_segments
from errors import EngineError

log = logging.getLogger(__name__)

WORKER_MODULE = "engines.tensor_parallel.worker"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
SHUTDOWN_GRACE_S = 5.0
PEER_LOST_SIGNS = ("was closed by the peer", "Failing pending tasks")  # mlx ring log lines


class TensorParallelEngine(Engine):
    """Rank 0 runs in a child process so a collective that hangs can always be killed.

    The other ranks are started elsewhere (by the agents, or by tests) with the same
    worker module; this engine only talks to rank 0, which leads them in lockstep.
    `on_lost(reason)` is called once when the group is lost (not after `abort`), from the
    runner thread or the engine's stdout reader thread: it should only schedule work.
    `rank_nodes` (node ids by rank) lets failure messages name the node at fault.
    """

    # every rank applies the same penalties and grammar to the same logits (lockstep.py)
    features = frozenset({"penalties", "logprobs", "grammar"})

    def __init__(
        self,
        model_path: Path | str,
        rank0_spec: dict[str, Any],
        on_lost: Callable[[str], None] | None = None,
        token_timeout_s: float = 10.0,
        first_token_timeout_s: float = 120.0,
        load_timeout_s: float = 300.0,
        rank_nodes: Sequence[str] = (),
    ) -> None:
        self.spec = WorkerSpec.from_dict(rank0_spec)
        if self.spec.rank != 0:
            raise ValueError(
                f"TensorParallelEngine drives rank 0, got a spec for rank {self.spec.rank}"
            )
        self.model_path = Path(model_path)
        self.on_lost = on_lost
        self.token_timeout_s = token_timeout_s
        self.first_token_timeout_s = first_token_timeout_s
        self.load_timeout_s = load_timeout_s
        self.rank_nodes = tuple(rank_nodes)
        self.tokenizer = None
        self.ready: dict[str, Any] = {}
        self._child: JsonChild | None = None
        self._state_lock = threading.Lock()
        self._lost_reason: str | None = None
        self._closed = False
        self._inserts: list[dict[str, Any]] = []  # sent with the next step
        self._removes: list[int] = []
        self._active: set[int] = set()  # uids the ranks hold
        self._prefilling: set[int] = set()  # uids with no token yet
        # The prefix cache: this engine decides hits and evictions, every rank holds its
        # shard of each entry (engines/tensor_parallel/shard_batch.py).
        options = self.spec.options
        disk_bytes = options.prefix_cache_disk_bytes if options.prefix_cache_dir else 0
        self.prefixes = GroupPrefixCache(
            options.prefix_cache_bytes, disk_bytes, self.spec.world_size
        )
        self.books = self.prefixes.books  # hits, waiters, late counts and the ranks' orders
        self.prefilled_tokens = 0  # prompt tokens the ranks ran through the model
        self.speculation: dict[str, int] | None = None  # rank 0's drafts, when it speculates
        self.step_timing = StepTimes()  # all_sum and compute per step (step_clock.py)

    @property
    def prefix_index(self) -> PrefixIndex:
        return self.books.index

    # -- lifecycle ---------------------------------------------------------------------------

    def load(self) -> None:
        """Load the tokenizer, start rank 0 and wait for the group; a second call is a no-op."""
        if self.ready:
            return
        try:
            self.tokenizer = load_serving_tokenizer(self.model_path)
        except (OSError, ValueError) as error:
            raise EngineError(f"cannot load tokenizer of {self.model_path}: {error}") from error
        self._start_worker()
        self.ready = self._wait_ready()
        self.prefixes.restore(self.ready.get("stored_entries") or [])
        log.info(
            "tensor-parallel group ready: %d ranks over %s, peak memory per rank %s",
            self.spec.world_size,
            self.spec.backend,
            self.ready.get("rank_peak_memory_bytes"),
        )

    def _start_worker(self) -> None:
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(PROJECT_ROOT), environment.get("PYTHONPATH")])
        )
        spec = {**self.spec.to_dict(), "model_path": str(self.model_path)}
        self._child = JsonChild(
            [sys.executable, "-m", WORKER_MODULE],
            name="tensor-parallel rank 0",
            env=environment,
            on_message=self._watch_message,
            on_stderr=self._watch_log,
            on_exit=self._watch_exit,
        )
        try:
            self._child.start(spec)
        except OSError as error:
            raise EngineError(f"cannot start the rank 0 worker: {error}") from error

    def _wait_ready(self) -> dict[str, Any]:
        assert self._child is not None
        try:
            if self._lost_reason is not None:  # aborted while it was starting
                raise ChildNotReady(self._lost_reason)
            return self._child.wait_ready(self.load_timeout_s)
        except ChildNotReady as error:
            self._child.kill()
            self._raise_if_lost()
            if error.timed_out:
                raise EngineError(
                    f"tensor-parallel rank 0 was not ready within {self.load_timeout_s:g} s: are "
                    f"all {self.spec.world_size} ranks started and reachable? last log: "
                    f"{self._child.last_log()}"
                ) from None
            raise EngineError(
                f"tensor-parallel group failed to load {self.model_path}: {error}"
            ) from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._child is not None:
            self._child.stop(SHUTDOWN_GRACE_S, ask=lambda: self._child.send({"cmd": "shutdown"}))

    # -- the batch -------------------------------------------------------------------------

    def insert(self, uid: int, request: GenerationRequest) -> int:
        if self._child is None:
            raise EngineError("tensor-parallel engine used before load()")
        if not request.prompt_tokens:
            raise EngineError("the prompt is empty: a request needs at least one token")
        if self.books.hold(uid, request):  # a long prefix still being prefilled: wait
            return 0  # its first output will say how many tokens it reused
        return self._insert_now(uid, request)

    def _insert_now(self, uid: int, request: GenerationRequest) -> int:
        hit = self.prefixes.start(uid, tuple(request.prompt_tokens))
        cached = hit.tokens if hit is not None else 0
        # every rank prefills the prompt after the entry's first `cached` tokens (all of it
        # if any rank cannot use the entry) and samples with the same seed
        seeded = replace(request, seed=request_seed(request))
        self._inserts.append(
            {
                "uid": uid,
                "entry": hit.entry_id if hit is not None else -1,
                "cached": cached,
                "request": seeded.document(),
            }
        )
        self._prefilling.add(uid)
        return cached

    def _let_in(self, waiters: list[tuple[int, GenerationRequest]]) -> None:
        """Requests that waited for a shared prompt join the batch, from its entry."""
        for uid, request in waiters:
            self.books.report_late(uid, self._insert_now(uid, request))

    def remove(self, uids: Sequence[int]) -> None:
        gone = set(uids)
        self.step_timing.forget(gone)
        unsent = [entry for entry in self._inserts if entry["uid"] in gone]
        self._inserts = [entry for entry in self._inserts if entry["uid"] not in gone]
        self.prefixes.forget(gone - {entry["uid"] for entry in unsent})
        self.prefixes.forget([entry["uid"] for entry in unsent], kept=False)
        self._removes += [uid for uid in gone & self._active]
        self._active -= gone
        self._prefilling -= gone
        if unsent:
            log.debug("dropped %d inserts before they reached the ranks", len(unsent))
        if self._removes and not self._active and not self._inserts:
            # Nothing left to step: tell the ranks now so their KV caches are freed.
            self._exchange(advance=False)
            if self.books.orders_pending:  # what they just kept goes to disk now too
                self._exchange(advance=False)

    def step(self) -> list[StepOutput]:
        """One lockstep step of the whole batch: send its changes, read its tokens."""
        self._let_in(self.books.released())  # owners gone, or waited long enough
        if not self._active and not self._inserts:
            return []
        decode = not (self._inserts or self._prefilling)  # no prompt rides along this step
        started = time.perf_counter()
        answer = self._exchange(advance=True)
        exchange_s = time.perf_counter() - started
        segments = step_segments(answer.get("timing"), exchange_s)
        self.step_timing.observe(segments, self._active, decode=decode)
        outputs = [StepOutput(uid, error=reason) for uid, reason in answer["refused"]]
        for uid, token, *logprobs in answer["tokens"]:
            self.prefixes.sampled(uid, token)
            if uid in self._active:
                self._prefilling.discard(uid)
                if logprobs:
                    chosen, best = logprobs
                    top = tuple((int(i), float(lp)) for i, lp in best)
                    outputs.append(StepOutput(uid, token, None, chosen, top))
                else:
                    outputs.append(StepOutput(uid, token))
        self._active -= {output.uid for output in outputs if output.error}
        self.prefixes.forget([output.uid for output in outputs if output.error], kept=False)
        owners = self.prefixes.owners_done(output.uid for output in outputs if not output.error)
        if owners:  # every rank keeps their prompts now; those waiting for them start there
            self._exchange(advance=False)
            self._let_in(self.books.released(owners))
        return [self._with_cached(output) for output in outputs]

    def _with_cached(self, output: StepOutput) -> StepOutput:
        cached = self.books.late_cached(output.uid)
        return output if cached is None else replace(output, cached_tokens=cached)

    def step_times(self, uid: int) -> dict[str, float]:
        return self.step_timing.request(uid)

    def evict_prefix_cache(self, keep_fraction: float) -> int:
        freed = self.books.evict(keep_fraction)
        if self.books.orders_pending and not self._active and not self._inserts:
            self._exchange(advance=False)  # idle: drop or spill them on every rank now
        return freed

    def _exchange(self, advance: bool) -> dict[str, Any]:
        """Send one step command to rank 0 and wait for its answer."""
        self._raise_if_lost()
        inserts, self._inserts = self._inserts, []
        removes, self._removes = self._removes, []
        orders = self.prefixes.take_orders()
        self._active |= {entry["uid"] for entry in inserts}
        # Prefill is chunked, but a step that prefills still takes far longer than a decode;
        # keeping a prompt waits for the step the ranks have queued.
        slow = (advance or bool(orders["keep"])) and bool(self._prefilling)
        self._send(
            {"cmd": "step", "insert": inserts, "remove": removes, **orders, "advance": advance}
        )
        while True:
            message = self._next_message(
                self.first_token_timeout_s if slow else self.token_timeout_s
            )
            if "tokens" in message:
                self.prefixes.index_kept(message.get("kept", []))
                self.prefixes.index_missed(message.get("missed", []))
                self.prefilled_tokens = message.get("prefilled_tokens", self.prefilled_tokens)
                self.speculation = message.get("speculation") or self.speculation
                return message
            if "error" in message:  # rank 0 could not read the command: an engine bug
                raise self._lose(f"rank 0 refused a step command: {message['error']}")

    def abort(self, reason: str) -> None:
        """Kill rank 0 now (any thread): an in-flight generation raises EngineError at once,
        with `reason` (the caller names the culprit: it knows which member it lost)."""
        self._lose(reason, notify=False)
        if self._child is not None:
            self._child.wake()

    # -- status ------------------------------------------------------------------------------

    def healthy(self) -> bool:
        return (
            self._lost_reason is None
            and not self._closed
            and self._child is not None
            and self._child.poll() is None
        )

    def info(self) -> EngineInfo:
        peaks = self.ready.get("rank_peak_memory_bytes") or []
        active = self.ready.get("rank_active_memory_bytes") or []
        ranks = []
        for rank in range(self.spec.world_size):
            entry: dict[str, Any] = {"rank": rank}
            if self.spec.hosts:
                entry["address"] = self.spec.hosts[rank][0]
            if rank < len(peaks) and rank < len(active):
                entry["peak_memory_bytes"] = peaks[rank]
                entry["active_memory_bytes"] = active[rank]
            ranks.append(entry)
        detail = {
            "backend": self.spec.backend,
            "model_path": str(self.model_path),
            "sync_every": self.spec.sync_every,
            "kv_bits": self.spec.options.kv_bits,
            "quantized_kv_start": self.spec.options.quantized_kv_start,
            "ranks": ranks,
            "prefix_cache": self.books.snapshot(),
            "prefilled_tokens": self.prefilled_tokens,
            "step_timing": self.step_timing.snapshot(),
            "healthy": self.healthy(),
        }
        if self.spec.options.most_drafted:
            counts = self.speculation or {"drafted": 0, "accepted": 0, "steps": 0}
            detail["speculation"] = {"most_drafted": self.spec.options.most_drafted, **counts}
        if self._lost_reason is not None:
            detail["lost_reason"] = self._lost_reason
        return EngineInfo(strategy="tp", world_size=self.spec.world_size, detail=detail)

    # -- the rank-0 process ------------------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> None:
        assert self._child is not None
        try:
            self._child.send(message)
        except (OSError, ValueError) as error:
            raise self._lose(
                f"cannot write to tensor-parallel {self._rank_zero()}: {error}"
            ) from error

    def _next_message(self, timeout_s: float) -> dict[str, Any]:
        assert self._child is not None
        self._raise_if_lost()
        try:
            message = self._child.next_message(timeout_s)
        except TimeoutError:
            raise self._lose(self._silence(timeout_s)) from None
        if message is None:
            raise self._lose(
                f"tensor-parallel {self._rank_zero()} {self._child.exit_description()}"
            )
        if message.get("event") == "failed":
            raise self._lose(self._failure(message))
        return message

    def _raise_if_lost(self) -> None:
        if self._lost_reason is not None:
            raise EngineError(self._lost_reason)

    def _lose(self, reason: str, notify: bool = True) -> EngineError:
        """Mark the group lost (once), kill rank 0, tell the supervisor; return the error."""
        with self._state_lock:
            first = self._lost_reason is None
            if first:
                self._lost_reason = reason
        if first:
            log.error("tensor-parallel group lost: %s", reason)
            if self._child is not None:
                self._child.kill()
            if notify and self.on_lost is not None:
                try:
                    self.on_lost(reason)
                except Exception:  # the supervisor's bug must not hide the engine error
                    log.exception("on_lost callback failed")
        return EngineError(self._lost_reason)

    def _watch_message(self, message: dict[str, Any]) -> None:
        if message.get("event") == "failed" and self.ready and not self._closed:
            self._lose(self._failure(message))  # tell the supervisor now, even if idle

    def _watch_exit(self, code: int) -> None:
        if self.ready and not self._closed:
            last = self._child.last_log()
            self._lose(
                f"tensor-parallel {self._rank_zero()} exited (code {code}); last log: {last}"
            )

    def _watch_log(self, line: str) -> None:
        if self.ready and not self._closed and any(sign in line for sign in PEER_LOST_SIGNS):
            # mlx's ring fails the pending collective, but an evaluation waiting on it may
            # never return: its log line is the earliest sign of a dead peer.
            self._lose(f"tensor-parallel {self._peers()} dropped its connection to rank 0 ({line})")
            self._child.wake()

    # -- naming the culprit ----------------------------------------------------------------------

    def _rank(self, rank: int) -> str:
        """'rank 1 on node X (10.0.0.2:52401)': which node, from the plan, and where."""
        where = []
        if rank < len(self.rank_nodes):
            where.append(f"on node {self.rank_nodes[rank]}")
        if rank < len(self.spec.hosts):
            where.append(f"({self.spec.hosts[rank][0]})")
        return " ".join([f"rank {rank}", *where])

    def _rank_zero(self) -> str:
        pid = self._child.pid if self._child is not None else None
        return f"{self._rank(0)}, pid {pid}"

    def _peers(self) -> str:
        """The ranks rank 0 waits on: the culprit when rank 0 itself is fine."""
        peers = [self._rank(rank) for rank in range(1, self.spec.world_size)]
        return peers[0] if len(peers) == 1 else "one of " + ", ".join(peers)

    def _silence(self, timeout_s: float) -> str:
        """Who did not answer a step within `timeout_s`: rank 0's own process, if it is the
        one stopped, else the peers it waits on."""
        if self._child is not None and self._child.is_stopped():
            return (
                f"tensor-parallel {self._rank_zero()} is stopped (SIGSTOP or a debugger): no "
                f"answer within {timeout_s:g} s"
            )
        return f"tensor-parallel {self._peers()} did not answer rank 0 within {timeout_s:g} s"

    def _failure(self, message: dict[str, Any]) -> str:
        """Rank 0's own failure report; when it blames a peer (a lost connection, a stalled
        collective), the peers it was waiting on are the culprit."""
        reason = message.get("reason")
        if "peer" in str(reason):
            return f"tensor-parallel {self._peers()} stopped answering: rank 0 reports {reason}"
        return f"tensor-parallel {self._rank_zero()} failed: {reason}"
