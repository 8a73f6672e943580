"""A loopback tensor-parallel group for benchmarks: ranks 1.. as worker processes, rank 0's
engine behind an EngineRunner in this process."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from engines.core.engine_options import EngineOptions
from engines.core.runner import EngineRunner
from engines.tensor_parallel import TensorParallelEngine, loopback_ring_specs
from tests.bench.common import PROJECT_ROOT

WORKER = [sys.executable, "-m", "engines.tensor_parallel.worker"]
LOAD_TIMEOUT_S = 180.0


@contextlib.contextmanager
def open_tensor_parallel_runner(
    model_path: Path,
    world_size: int,
    max_batch: int = 16,
    prefix_cache_bytes: int = 0,
    **options: object,
) -> Iterator[EngineRunner]:
    # Every rank shares this machine: each gets its share of the cores, as launch.py does.
    threads = max(1, (os.cpu_count() or 1) // world_size)
    specs = loopback_ring_specs(
        world_size,
        model_path,
        EngineOptions(
            max_batch=max_batch,
            blas_threads=threads,
            prefix_cache_bytes=prefix_cache_bytes,
            **options,
        ),
    )
    ranks: list[subprocess.Popen[bytes]] = []
    runner: EngineRunner | None = None
    try:
        for spec in specs[1:]:
            rank = subprocess.Popen(
                WORKER, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=PROJECT_ROOT
            )
            ranks.append(rank)
            assert rank.stdin is not None
            rank.stdin.write((json.dumps(spec) + "\n").encode())
            rank.stdin.flush()  # stdin stays open: EOF would tell the rank its agent is gone
        engine = TensorParallelEngine(model_path, specs[0], load_timeout_s=LOAD_TIMEOUT_S)
        runner = EngineRunner(engine, queue_size=64, max_batch=max_batch)
        runner.start(LOAD_TIMEOUT_S)
        yield runner
    finally:
        if runner is not None:
            runner.close()
        for rank in ranks:
            try:
                rank.wait(10)
            except subprocess.TimeoutExpired:
                rank.kill()
                rank.wait()
