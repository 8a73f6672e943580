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


def single(model_path: str, prefix_cache_tier_root: str | None = None, **options: Any) -> Engine:
    from engines.single.engine import SingleEngine

    root = Path(prefix_cache_tier_root) if prefix_cache_tier_root else None
    return SingleEngine(Path(model_path), prefix_cache_tier_root=root, **options)


def tensor_parallel(
    model_path: str, rank0_spec: dict[str, Any], rank_nodes: list[str], **options: Any
) -> Engine:
    from engines.tensor_parallel.engine import TensorParallelEngine

    return TensorParallelEngine(Path(model_path), rank0_spec, rank_nodes=rank_nodes, **options)


def pipeline(
    model_path: str,
    layers: list[int],
    prefix_cache_dir: str | None = None,
    listener: socket.socket | None = None,
    **options: Any,
) -> Engine:
    from engines.pipeline.engine import EncryptedPipelineEngine

    start, stop = layers
    return EncryptedPipelineEngine(
        Path(model_path),
        range(start, stop),
        return_listener=listener,
        prefix_cache_dir=Path(prefix_cache_dir) if prefix_cache_dir else None,
        **options,
    )
