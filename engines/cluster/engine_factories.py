"""The coordinator's part of each plan, built from plain options (an EngineSpec's factories).

Each function turns msgpack-able values back into what its engine's constructor takes, so
the launcher's description builds the same engine in the serving process or in the
engine-core process.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from engines.core.engine import Engine
from engines.core.engine_options import EngineOptions


def single(model_path: str, options: EngineOptions) -> Engine:
    from engines.single.engine import SingleEngine

    return SingleEngine(Path(model_path), options)


def tensor_parallel(
    model_path: str,
    rank0_spec: dict[str, Any],
    rank_nodes: list[str],
    options: EngineOptions,
    **arguments: Any,
) -> Engine:
    from engines.tensor_parallel.engine import TensorParallelEngine

    # rank 0 runs on this machine: with this machine's options (its spec's copy is the same)
    spec = {**rank0_spec, "options": options.document()}
    return TensorParallelEngine(Path(model_path), spec, rank_nodes=rank_nodes, **arguments)


def pipeline(
    model_path: str,
    layers: list[int],
    options: EngineOptions,
    listener: socket.socket | None = None,
    **arguments: Any,
) -> Engine:
    from engines.pipeline.engine import EncryptedPipelineEngine

    start, stop = layers
    return EncryptedPipelineEngine(
        Path(model_path), range(start, stop), options=options, return_listener=listener,
        **arguments,
    )  # fmt: skip
