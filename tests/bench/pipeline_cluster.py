"""A loopback pipeline for benchmarks: stages 1.. as worker processes, stage 0's engine behind
an EngineRunner in this process, layers split evenly."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from discovery.cluster_key import generate_key
from engines.core.engine_options import EngineOptions
from engines.core.runner import EngineRunner
from engines.model.info import inspect_model
from engines.pipeline.engine import EncryptedPipelineEngine
from engines.pipeline.stage_worker import StageProcess
from planner import allocate_layers

HOST = "127.0.0.1"
LOAD_TIMEOUT_S = 180.0


@contextlib.contextmanager
def open_pipeline_runner(
    model_path: Path,
    stages: int,
    max_batch: int = 16,
    prefix_cache_bytes: int = 0,
    prefix_cache_disk_bytes: int = 0,
    prefix_cache_dir: Path | None = None,
    most_drafted: int = 0,
) -> Iterator[EngineRunner]:
    """`prefix_cache_dir`: each stage keeps its disk tier under its own subdirectory of it, as
    if on its own machine; `most_drafted`: speculation by prompt lookup (0: off)."""
    disk = prefix_cache_disk_bytes if prefix_cache_dir is not None else 0
    layers = allocate_layers(inspect_model(model_path).num_layers, [1] * stages)
    key = generate_key()
    threads = max(1, (os.cpu_count() or 1) // stages)  # as launch.py shares a machine
    listener = socket.create_server((HOST, 0))
    workers: list[StageProcess] = []
    runner: EngineRunner | None = None
    try:
        next_port = listener.getsockname()[1]
        for index in reversed(range(1, stages)):
            spec = {
                "model_path": str(model_path),
                "layers": [layers[index].start, layers[index].stop],
                "is_last": index == stages - 1,
                "listen_host": HOST,
                "next_host": HOST,
                "next_port": next_port,
                "cluster_key": key.hex(),
                "options": EngineOptions(
                    blas_threads=threads,
                    prefix_cache_disk_bytes=disk,
                    prefix_cache_dir=str(prefix_cache_dir / f"stage-{index}") if disk else None,
                ).document(),
            }
            worker = StageProcess.start(
                spec, stderr=subprocess.DEVNULL, ready_timeout_s=LOAD_TIMEOUT_S
            )
            workers.insert(0, worker)
            next_port = worker.port
        remote = [
            {"host": HOST, "port": worker.port, "layers": [r.start, r.stop]}
            for worker, r in zip(workers, layers[1:], strict=True)
        ]
        engine = EncryptedPipelineEngine(
            model_path,
            layers[0],
            remote,
            HOST,
            key,
            options=EngineOptions(
                prefix_cache_bytes=prefix_cache_bytes,
                prefix_cache_disk_bytes=disk,
                prefix_cache_dir=str(prefix_cache_dir / "stage-0") if disk else None,
                most_drafted=most_drafted,
            ),
            return_listener=listener,
        )
        runner = EngineRunner(engine, queue_size=64, max_batch=max_batch)
        runner.start(LOAD_TIMEOUT_S)
        yield runner
    finally:
        if runner is not None:
            runner.close()
        else:
            listener.close()
        for worker in workers:
            worker.stop()
