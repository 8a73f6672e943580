"""One tensor-parallel rank as a process: `python -m engines.tensor_parallel.worker`.

stdin:  line 1 is the JSON WorkerSpec; rank 0 then reads commands, one JSON object per line:
        {"cmd": "step", "remove": [uid, ...], "insert": [{"uid", "entry", "cached", "request":
        GenerationRequest.document()}, ...], "evict": [entry, ...], "spill": [entry, ...],
        "keep": [[uid, entry], ...], "advance": true|false},
        {"cmd": "shutdown"}.
stdout: JSON lines only: {"event": "ready", ..., "stored_entries": [[entry, tokens, bytes],
        ...]} or {"event": "failed", "reason"} once loaded; rank 0 then answers every step with
        {"tokens": [[uid, token], ...], "refused": [[uid, reason], ...], "kept": [[entry,
        tokens held, bytes], ...], "missed": [[uid, entry], ...], "prefilled_tokens": n,
        "speculation": {"drafted", "accepted", "steps"} or null, "timing": {"all_sum": s,
        "step": s}}, or {"error", "fatal": false} for a command it cannot read.
stderr: logs.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

import mlx.core as mx

from discovery.json_child import ProtocolOutput, configure_child_logging, open_protocol_output
from engines.core import blas
from engines.model.packed_quantized import pack
from engines.model.precision import upcast_on_cpu
from engines.tensor_parallel.group import WorkerSpec, group_environment
from engines.tensor_parallel.lockstep import (
    COMMAND_NAMES,
    PING,
    SHUTDOWN,
    STEP,
    Command,
    Lockstep,
    idle_wait_s,
    ping_after_s,
)
from engines.tensor_parallel.rank_disk import agree_on_stored, open_rank_disk
from engines.tensor_parallel.rank_grammar import RankGrammars
from engines.tensor_parallel.rank_io import CommandReader, Watchdog
from engines.tensor_parallel.shard_batch import ShardBatch
from engines.tensor_parallel.step_clock import StepClock
from engines.tensor_parallel.step_commands import parse_step
from engines.weights.tp_share import load_rank_share
from planner.decision import tp_split_problems

log = logging.getLogger(__name__)


def resident_bytes() -> int:
    """Current RSS on Linux, peak RSS elsewhere (macOS reports ru_maxrss in bytes)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def check_shardable(model_path: Path, world_size: int) -> None:
    """Refuse, precisely, a model tp cannot split: the planner's own rule (one source of truth)."""
    config_file = model_path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model directory {model_path} has no config.json")
    config = json.loads(config_file.read_text())
    heads = config.get("num_attention_heads") or 0
    problems = tp_split_problems(
        heads,
        config.get("num_key_value_heads", heads) or 0,
        config.get("intermediate_size") or 0,
        world_size,
    )
    if problems:
        raise ValueError(
            f"tensor parallel over {world_size} ranks needs attention heads, KV heads and the "
            f"MLP size divisible by {world_size}; {model_path} has {', '.join(problems)}: "
            "use pp or single"
        )


def join_group(spec: WorkerSpec) -> mx.distributed.Group:
    """Write the hostfile / device matrix, let mlx read it while joining, then delete it."""
    with tempfile.TemporaryDirectory(prefix=f"tandem-rank{spec.rank}-") as directory:
        os.environ.update(group_environment(spec, Path(directory)))
        return mx.distributed.init(backend=spec.backend, strict=True)


def load_shard(
    spec: WorkerSpec, output: ProtocolOutput | None = None
) -> tuple[Any, int | None, mx.distributed.Group, RankGrammars]:
    """Join the group and load this rank's shard with mlx-lm's own `Model.shard` (from the
    whole model, or from the rank's share the coordinator sent); the grammars load the
    tokenizer from the same directory when a sequence first needs it.

    The weights are loaded lazily and evaluated one layer at a time after sharding, so a
    rank's peak memory stays near its shard instead of the whole model (evaluating every
    parameter at once, as `sharded_load` does, briefly holds the full tensors).
    """
    from discovery.cluster_key import parse_key
    from engines.weights.fetch import model_for_assignment, progress_events

    # A directory, repo@commit in this machine's HF cache, or the coordinator's copy.
    key = parse_key(spec.cluster_key) if spec.cluster_key else None
    model_path = model_for_assignment(
        spec.model_path, spec.weights, key, progress_events(output) if output else None
    )
    check_shardable(model_path, spec.world_size)
    group = join_group(spec)
    if group.size() != spec.world_size or group.rank() != spec.rank:
        raise ValueError(
            f"mlx joined rank {group.rank()} of {group.size()}, the spec says "
            f"{spec.rank} of {spec.world_size}"
        )
    log.info("joined %s group as rank %d of %d", spec.backend, spec.rank, spec.world_size)
    model, config = load_rank_share(model_path, group)  # a received share or the whole model
    for layer in getattr(model, "layers", []):
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    upcast_on_cpu(model, spec.options.upcast)
    (model,) = pack(model)  # the kernel rounds alike on every rank: no clock decides it
    model_vocab = getattr(getattr(model, "args", None), "vocab_size", 0) or 0
    grammars = RankGrammars(model_path, model_vocab, config.get("eos_token_id"))
    return model, config.get("vocab_size"), group, grammars


def gather_memory(lockstep: Lockstep) -> tuple[list[int], list[int]]:
    """Every rank's peak and active mlx memory in bytes; the all_sum is the ready barrier."""
    size, rank = lockstep.world_size, lockstep.rank
    slots = [0] * (2 * size)
    slots[rank] = mx.get_peak_memory() // 1024  # KiB keeps 2 TiB inside an int32
    slots[size + rank] = mx.get_active_memory() // 1024
    kib = lockstep.sum_across_ranks(slots)
    return [value * 1024 for value in kib[:size]], [value * 1024 for value in kib[size:]]


@dataclass
class Rank:
    """One loaded rank: rank 0 leads (stdin -> broadcasts -> stdout), the others follow."""

    spec: WorkerSpec
    lockstep: Lockstep
    batch: ShardBatch
    vocab_size: int | None
    output: ProtocolOutput
    watchdog: Watchdog
    grammars: RankGrammars | None = None

    def lead(self) -> None:
        """Rank 0: turn stdin step commands into broadcasts; PING when none came in time."""
        reader = CommandReader(sys.stdin.buffer)
        pings = 0
        advanced = 0
        deadline = time.monotonic() + idle_wait_s(0, self.spec.heartbeat_s)
        while True:
            timeout_s = max(0.0, deadline - time.monotonic()) if self.spec.heartbeat_s else None
            message = reader.next(timeout_s)
            refused: list[tuple[Any, str]] = []
            if message is None:
                command = Command(PING)
            elif message.get("cmd") in ("shutdown", "eof"):
                log.info("shutting the group down (%s)", message["cmd"])
                # A dead peer would hold this broadcast forever: the watchdog ends the process.
                self.watchdog.arm(self.spec.stall_timeout_s, "the shutdown broadcast")
                self.lockstep.broadcast_command(Command(SHUTDOWN))
                return
            else:
                try:
                    if message.get("cmd") != "step":
                        raise ValueError(message.get("reason", f"unknown command {message}"))
                    command, refused = parse_step(message, self.vocab_size, self.grammars)
                except (TypeError, ValueError) as error:
                    self.output.write({"error": str(error), "fatal": False})
                    continue  # nothing was broadcast: the other ranks keep their schedule
            if command.kind == STEP:
                pings, wait_after_s = 0, 0.0  # the engine sends the next step right away
                if command.advance:
                    advanced += 1
                    command = replace(command, sync=advanced % self.spec.sync_every == 0)
            else:
                pings += 1
                wait_after_s = idle_wait_s(pings, self.spec.heartbeat_s)
            command = replace(command, wait_after_s=wait_after_s)
            # the clock waits for the forward pass queued last step: a frozen peer stalls it
            self.watchdog.arm(self.spec.stall_timeout_s, "the previous step's forward pass")
            clock = StepClock(self.lockstep)
            tokens = self.run(command)
            if command.kind == STEP:
                timing = clock.read()
                self.output.write(
                    {
                        "tokens": tokens,
                        "refused": refused,
                        "kept": self.batch.drain_kept(),
                        "missed": self.batch.drain_missed(),
                        "prefilled_tokens": self.batch.prefilled_tokens,
                        "speculation": self.batch.speculation(),
                        "timing": timing,
                    }
                )
            deadline = time.monotonic() + ping_after_s(command)

    def follow(self) -> None:
        """Ranks > 0: wait for rank 0's next command and run it on this shard."""
        while True:
            if self.spec.heartbeat_s:  # rank 0 pings at least every heartbeat_s while idle
                self.watchdog.arm(self.spec.stall_timeout_s, "waiting for rank 0")
            command = self.lockstep.broadcast_command()
            self.watchdog.disarm()
            if command.kind == SHUTDOWN:
                log.info("rank 0 shut the group down")
                return
            self.run(command, broadcast=False)
            time.sleep(command.wait_after_s)

    def run(self, command: Command, broadcast: bool = True) -> list[tuple[int, int]]:
        """(Rank 0: broadcast, then) apply the command to this rank's batch, under the watchdog."""
        self.watchdog.arm(self.spec.stall_timeout_s, f"a {COMMAND_NAMES[command.kind]} step")
        try:
            if broadcast:
                self.lockstep.broadcast_command(command)
            if command.kind != STEP:
                return []
            tokens = self.batch.apply(command)
            if command.sync:
                self.lockstep.sync(self.batch.checksum)
            return tokens
        finally:
            self.watchdog.disarm()


def exit_when_stdin_closes() -> None:
    """Ranks > 0: the agent keeps stdin open while it lives; EOF means it is gone."""
    for _ in sys.stdin.buffer:
        pass
    log.info("stdin closed: the agent is gone, exiting")
    os._exit(0)  # the main thread may be blocked in a collective


def run(spec: WorkerSpec, output: ProtocolOutput) -> int:
    def fail(reason: str) -> NoReturn:
        log.error("rank %d failed: %s", spec.rank, reason)
        output.write({"event": "failed", "rank": spec.rank, "reason": reason})
        os._exit(1)  # the main thread may be stuck in a collective that cannot be interrupted

    log.info("BLAS: %s", blas.set_threads(spec.options.blas_threads).describe())
    watchdog = Watchdog(fail)
    if spec.rank != 0:
        threading.Thread(target=exit_when_stdin_closes, name="stdin-watch", daemon=True).start()
    started = time.monotonic()
    try:
        model, vocab_size, group, grammars = load_shard(spec, output)
        lockstep = Lockstep(group)
        peaks, active = gather_memory(lockstep)
        disk, stored = open_rank_disk(spec)
        if spec.options.prefix_cache_bytes and spec.options.prefix_cache_disk_bytes:  # alike
            stored_entries = agree_on_stored(lockstep, disk, stored)
        else:
            stored_entries = []
    except Exception as error:  # every load failure becomes one "failed" line
        fail(f"{type(error).__name__}: {error}")
    output.write(
        {
            "event": "ready",
            "rank": spec.rank,
            "world_size": spec.world_size,
            "peak_memory_bytes": mx.get_peak_memory(),
            "rss_bytes": resident_bytes(),
            "rank_peak_memory_bytes": peaks,
            "rank_active_memory_bytes": active,
            "load_s": round(time.monotonic() - started, 3),
            "stored_entries": stored_entries,
        }
    )
    try:
        options = spec.options
        batch = ShardBatch(
            model,
            options.max_batch,
            options.prefill_chunk,
            keep_prefixes=options.prefix_cache_bytes > 0,
            grammars=grammars,
            disk=disk,
            kv_bits=options.kv_bits,
            quantized_kv_start=options.quantized_kv_start,
            most_drafted=options.most_drafted,
            sum_across_ranks=lockstep.sum_across_ranks,
        )
        rank = Rank(spec, lockstep, batch, vocab_size, output, watchdog, grammars)
        if spec.rank == 0:
            rank.lead()
        else:
            rank.follow()
        batch.close()  # the disk tier writes what it was given: its files outlive the group
    except Exception as error:  # a lost peer, a divergence: the group is unusable
        fail(f"{type(error).__name__}: {error}")
    return 0


def main() -> int:
    output = open_protocol_output()
    raw = sys.stdin.buffer.readline()
    try:
        spec = WorkerSpec.from_dict(json.loads(raw))
    except (ValueError, TypeError) as error:
        output.write({"event": "failed", "reason": f"invalid worker spec: {error}"})
        return 2
    configure_child_logging(f"rank{spec.rank}", spec.log_level)
    return run(spec, output)


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    # Reader threads may sit in a blocking stdin read that interpreter shutdown would trip on.
    os._exit(code)
