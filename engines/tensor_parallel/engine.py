"""TensorParallelEngine: the coordinator's side of a tp group, driving the rank-0 worker process."""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mlx_lm.utils import load_config, load_tokenizer

from planner.errors import EngineError

from ..base import Engine, EngineInfo, GenerationRequest, StepOutput
from ..prefix_index import PrefixIndex
from ..sampling import request_seed
from ..step_timing import StepTimes
from .group import WorkerSpec
from .step_clock import step_segments

log = logging.getLogger(__name__)

WORKER_MODULE = "engines.tensor_parallel.worker"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
STDERR_TAIL = 20
SHUTDOWN_GRACE_S = 5.0
KILL_GRACE_S = 2.0
PEER_LOST_SIGNS = ("was closed by the peer", "Failing pending tasks")  # mlx ring log lines


class TensorParallelEngine(Engine):
    """Rank 0 runs in a child process so a collective that hangs can always be killed.

    The other ranks are started elsewhere (by the agents, or by tests) with the same
    worker module; this engine only talks to rank 0, which leads them in lockstep.
    `on_lost(reason)` is called once when the group is lost (not after `abort`), from the
    runner thread or the engine's stdout reader thread: it should only schedule work.
    """

    def __init__(
        self,
        model_path: Path | str,
        rank0_spec: dict[str, Any],
        on_lost: Callable[[str], None] | None = None,
        token_timeout_s: float = 10.0,
        first_token_timeout_s: float = 120.0,
        load_timeout_s: float = 300.0,
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
        self.tokenizer = None
        self.ready: dict[str, Any] = {}
        self._process: subprocess.Popen[bytes] | None = None
        self._messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL)
        self._threads: list[threading.Thread] = []
        self._write_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._lost_reason: str | None = None
        self._closed = False
        self._inserts: list[dict[str, Any]] = []  # sent with the next step
        self._removes: list[int] = []
        self._active: set[int] = set()  # uids the ranks hold
        self._prefilling: set[int] = set()  # uids with no token yet
        # The prefix cache: this engine decides hits and evictions, every rank holds its
        # shard of each entry (engines/tensor_parallel/shard_batch.py).
        self.prefix_index = PrefixIndex(self.spec.prefix_cache_bytes)
        self._evicts: list[int] = []  # entries every rank drops with the next step
        self._tokens: dict[int, list[int]] = {}  # uid -> prompt + tokens so far, until kept
        self.step_timing = StepTimes()  # all_sum and compute per step (step_clock.py)

    # -- lifecycle ---------------------------------------------------------------------------

    def load(self) -> None:
        """Load the tokenizer, start rank 0 and wait for the group; a second call is a no-op."""
        if self.ready:
            return
        try:
            config = load_config(self.model_path)
            self.tokenizer = load_tokenizer(
                self.model_path, eos_token_ids=config.get("eos_token_id", None)
            )
        except (OSError, ValueError) as error:
            raise EngineError(f"cannot load tokenizer of {self.model_path}: {error}") from error
        self._start_worker()
        self.ready = self._wait_ready()
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
        self._process = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=environment,
        )
        log.info("started tensor-parallel rank 0 worker (pid %d)", self._process.pid)
        for target, name in (
            (self._read_stdout, "tp-rank0-stdout"),
            (self._read_stderr, "tp-rank0-stderr"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        try:
            self._write(spec)
        except (OSError, ValueError) as error:
            self._kill()
            raise EngineError(f"cannot hand the spec to the rank 0 worker: {error}") from error

    def _wait_ready(self) -> dict[str, Any]:
        try:
            message = self._messages.get(timeout=self.load_timeout_s)
        except queue.Empty:
            self._kill()
            raise EngineError(
                f"tensor-parallel rank 0 was not ready within {self.load_timeout_s:g} s: are all "
                f"{self.spec.world_size} ranks started and reachable? last log: {self._last_log()}"
            ) from None
        if message is None:
            raise EngineError(f"tensor-parallel rank 0 failed to start: {self._exit_description()}")
        if message.get("event") != "ready":
            self._kill()
            reason = message.get("reason", message)
            raise EngineError(f"tensor-parallel group failed to load {self.model_path}: {reason}")
        return message

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        process = self._process
        if process is not None and process.poll() is None:
            try:
                self._write({"cmd": "shutdown"})
                process.wait(timeout=SHUTDOWN_GRACE_S)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                log.warning("rank 0 did not shut down within %g s; killing it", SHUTDOWN_GRACE_S)
        self._kill()
        for thread in self._threads:
            if thread is not threading.current_thread():  # on_lost may call close() here
                thread.join(KILL_GRACE_S)

    # -- the batch -------------------------------------------------------------------------

    def insert(self, uid: int, request: GenerationRequest) -> None:
        if self._process is None:
            raise EngineError("tensor-parallel engine used before load()")
        if not request.prompt_tokens:
            raise EngineError("the prompt is empty: a request needs at least one token")
        hit = self.prefix_index.lookup(request.prompt_tokens)
        cached = hit.tokens if hit is not None else 0
        if self.prefix_index.enabled:
            self._tokens[uid] = list(request.prompt_tokens)
        self._inserts.append(
            {
                "uid": uid,
                "entry": hit.entry_id if hit is not None else -1,
                "cached": cached,
                "prompt": list(request.prompt_tokens[cached:]),
                "max_tokens": request.max_tokens,
                "temperature": request.temperature,
                "top_p": request.top_p,
                "seed": request_seed(request),
                "repetition_penalty": request.repetition_penalty,
                "presence_penalty": request.presence_penalty,
                "frequency_penalty": request.frequency_penalty,
                "logprobs": request.logprobs,
            }
        )
        self._prefilling.add(uid)
        return cached

    def remove(self, uids: Sequence[int]) -> None:
        gone = set(uids)
        self.step_timing.forget(gone)
        unsent = [entry for entry in self._inserts if entry["uid"] in gone]
        self._inserts = [entry for entry in self._inserts if entry["uid"] not in gone]
        for entry in unsent:
            self._tokens.pop(entry["uid"], None)
        self._removes += [uid for uid in gone & self._active]
        self._active -= gone
        self._prefilling -= gone
        if unsent:
            log.debug("dropped %d inserts before they reached the ranks", len(unsent))
        if self._removes and not self._active and not self._inserts:
            # Nothing left to step: tell the ranks now so their KV caches are freed.
            self._exchange(advance=False)

    def step(self) -> list[StepOutput]:
        """One lockstep step of the whole batch: send its changes, read its tokens."""
        if not self._active and not self._inserts:
            return []
        started = time.perf_counter()
        answer = self._exchange(advance=True)
        exchange_s = time.perf_counter() - started
        self.step_timing.observe(step_segments(answer.get("timing"), exchange_s), self._active)
        outputs = [StepOutput(uid, error=reason) for uid, reason in answer["refused"]]
        for uid, token, *logprobs in answer["tokens"]:
            if uid in self._tokens:
                self._tokens[uid].append(token)
            if uid in self._active:
                self._prefilling.discard(uid)
                if logprobs:
                    chosen, best = logprobs
                    top = tuple((int(i), float(lp)) for i, lp in best)
                    outputs.append(StepOutput(uid, token, None, chosen, top))
                else:
                    outputs.append(StepOutput(uid, token))
        self._active -= {output.uid for output in outputs if output.error}
        for output in outputs:
            if output.error:
                self._tokens.pop(output.uid, None)
        self._index_kept(answer.get("kept", []))
        return outputs

    def step_times(self, uid: int) -> dict[str, float]:
        return self.step_timing.request(uid)

    def evict_prefix_cache(self, keep_fraction: float) -> int:
        before = self.prefix_index.nbytes
        self._evicts += self.prefix_index.evict(keep_fraction)
        if self._evicts and not self._active and not self._inserts:
            self._exchange(advance=False)  # idle: drop them on every rank now
        return before - self.prefix_index.nbytes

    def _index_kept(self, kept: list[list[int]]) -> None:
        """Index the entries the ranks kept ([uid, tokens held, bytes on rank 0])."""
        for uid, length, rank_bytes in kept:
            tokens = self._tokens.pop(uid, [])[:length]
            if len(tokens) < length:  # never expected: the ranks hold tokens we never saw
                log.warning(
                    "rank 0 kept %d tokens of sequence %d, %d known", length, uid, len(tokens)
                )
                self._evicts.append(uid)
                continue
            # every rank holds an equal shard, so the group holds world_size times rank 0's
            self._evicts += self.prefix_index.add(uid, tokens, rank_bytes * self.spec.world_size)

    def _exchange(self, advance: bool) -> dict[str, Any]:
        """Send one step command to rank 0 and wait for its answer."""
        self._raise_if_lost()
        inserts, self._inserts = self._inserts, []
        removes, self._removes = self._removes, []
        evicts, self._evicts = self._evicts, []
        self._active |= {entry["uid"] for entry in inserts}
        # Prefill is chunked, but a step that prefills still takes far longer than a decode.
        slow = advance and bool(self._prefilling)
        self._send(
            {
                "cmd": "step",
                "insert": inserts,
                "remove": removes,
                "evict": evicts,
                "advance": advance,
            }
        )
        while True:
            message = self._next_message(
                self.first_token_timeout_s if slow else self.token_timeout_s
            )
            if "tokens" in message:
                if not advance:
                    self._index_kept(message.get("kept", []))
                return message
            if "error" in message:  # rank 0 could not read the command: an engine bug
                raise self._lose(f"rank 0 refused a step command: {message['error']}")

    def abort(self, reason: str) -> None:
        """Kill rank 0 now (any thread): an in-flight generation raises EngineError at once."""
        self._lose(f"aborted: {reason}", notify=False)
        self._messages.put(None)

    # -- status ------------------------------------------------------------------------------

    def healthy(self) -> bool:
        process = self._process
        return (
            self._lost_reason is None
            and not self._closed
            and process is not None
            and process.poll() is None
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
            "ranks": ranks,
            "prefix_cache": self.prefix_index.snapshot(),
            "step_timing": self.step_timing.snapshot(),
            "healthy": self.healthy(),
        }
        if self._lost_reason is not None:
            detail["lost_reason"] = self._lost_reason
        return EngineInfo(strategy="tp", world_size=self.spec.world_size, detail=detail)

    # -- the rank-0 process ------------------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self._write(message)
        except (OSError, ValueError) as error:
            raise self._lose(f"cannot write to the rank 0 worker: {error}") from error

    def _write(self, message: dict[str, Any]) -> None:
        assert self._process is not None and self._process.stdin is not None
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        with self._write_lock:
            self._process.stdin.write(data)
            self._process.stdin.flush()

    def _next_message(self, timeout_s: float) -> dict[str, Any]:
        self._raise_if_lost()
        try:
            message = self._messages.get(timeout=timeout_s)
        except queue.Empty:
            raise self._lose(f"no answer from rank 0 within {timeout_s:g} s") from None
        if message is None:
            raise self._lose(self._exit_description())
        if message.get("event") == "failed":
            raise self._lose(str(message.get("reason")))
        return message

    def _raise_if_lost(self) -> None:
        if self._lost_reason is not None:
            raise EngineError(f"tensor-parallel rank 0 lost: {self._lost_reason}")

    def _lose(self, reason: str, notify: bool = True) -> EngineError:
        """Mark the group lost (once), kill rank 0, tell the supervisor; return the error."""
        with self._state_lock:
            first = self._lost_reason is None
            if first:
                self._lost_reason = reason
        if first:
            log.error("tensor-parallel rank 0 lost: %s", reason)
            self._kill()
            if notify and self.on_lost is not None:
                try:
                    self.on_lost(reason)
                except Exception:  # the supervisor's bug must not hide the engine error
                    log.exception("on_lost callback failed")
        return EngineError(f"tensor-parallel rank 0 lost: {self._lost_reason}")

    def _kill(self) -> None:
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.kill()
        try:
            process.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            log.error("rank 0 worker (pid %d) did not exit after SIGKILL", process.pid)
        if process.stdin is not None:
            try:
                process.stdin.close()
            except OSError:
                pass

    def _exit_description(self) -> str:
        code = None
        if self._process is not None:
            try:
                code = self._process.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        return f"the worker process exited (code {code}); last log: {self._last_log()}"

    def _last_log(self) -> str:
        return self._stderr_tail[-1] if self._stderr_tail else "(none)"

    def _read_stdout(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for raw in self._process.stdout:
            try:
                message = json.loads(raw)
            except ValueError:
                log.warning("rank 0 wrote a line that is not JSON: %r", raw[:200])
                continue
            if not isinstance(message, dict):
                continue
            if message.get("event") == "failed" and self.ready and not self._closed:
                self._lose(str(message.get("reason")))  # tell the supervisor now, even if idle
            self._messages.put(message)
        if self.ready and not self._closed:
            self._lose(self._exit_description())
        self._messages.put(None)

    def _read_stderr(self) -> None:
        assert self._process is not None and self._process.stderr is not None
        for raw in self._process.stderr:
            line = raw.decode(errors="replace").rstrip()
            if line:
                self._stderr_tail.append(line)
                log.info("rank 0 | %s", line)
                if self.ready and not self._closed and any(s in line for s in PEER_LOST_SIGNS):
                    # mlx's ring fails the pending collective, but an evaluation waiting on it
                    # may never return: its log line is the earliest sign of a dead peer.
                    self._lose(f"a peer's connection broke ({line})")
                    self._messages.put(None)
