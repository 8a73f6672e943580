"""Rank workers for tp tests: started the way an agent starts them, stopped for sure."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llguidance import LLMatcher

from engines.api.constraints import ANY_OBJECT, JSON_OPTIONS
from engines.core.engine_options import EngineOptions
from engines.tensor_parallel import TensorParallelEngine, loopback_ring_specs

PROJECT_ROOT = Path(__file__).resolve().parents[2]
WORKER = [sys.executable, "-m", "engines.tensor_parallel.worker"]
# JSON mode as the API compiles it (engines/api/constraints.py)
GRAMMAR = LLMatcher.grammar_from_json_schema(ANY_OBJECT, overrides=JSON_OPTIONS)
LOAD_TIMEOUT_S = 60.0
PROMPTS = ("The quick brown fox", "Once upon a time, in a city by the sea,", "def main():")


def start_rank(spec: dict[str, Any]) -> subprocess.Popen[bytes]:
    """Start one rank worker the way an agent does: the spec as the first stdin line."""
    process = subprocess.Popen(
        WORKER,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=PROJECT_ROOT,
    )
    assert process.stdin is not None
    process.stdin.write((json.dumps(spec) + "\n").encode())
    process.stdin.flush()  # stdin stays open: EOF would tell the worker its agent is gone
    return process


def stop_processes(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()


@dataclass
class Cluster:
    engine: TensorParallelEngine
    ranks: list[subprocess.Popen[bytes]]
    lost: list[str]


def open_cluster(
    model_dir: Path,
    world_size: int = 2,
    spec_options: dict[str, Any] | None = None,
    **engine_options: Any,
) -> Cluster:
    """A loaded group on 127.0.0.1: every rank's spec gets `spec_options` (prefix cache, KV
    bits, ...), the engine `engine_options`."""
    specs = loopback_ring_specs(world_size, model_dir, EngineOptions(**(spec_options or {})))
    ranks = [start_rank(spec) for spec in specs[1:]]
    lost: list[str] = []
    engine = TensorParallelEngine(
        model_dir, specs[0], on_lost=lost.append, load_timeout_s=LOAD_TIMEOUT_S, **engine_options
    )
    try:
        engine.load()
    except BaseException:
        engine.close()
        stop_processes(ranks)
        raise
    return Cluster(engine, ranks, lost)


def close_cluster(cluster: Cluster) -> None:
    cluster.engine.close()
    stop_processes(cluster.ranks)
