"""Tensor parallel: each rank holds a `Model.shard` slice; `all_sum` joins them in every layer."""

from engines.tensor_parallel.engine import TensorParallelEngine
from engines.tensor_parallel.group import (
    WorkerSpec,
    free_port,
    jaccl_specs,
    loopback_ring_specs,
    ring_specs,
)

__all__ = [
    "TensorParallelEngine",
    "WorkerSpec",
    "free_port",
    "jaccl_specs",
    "loopback_ring_specs",
    "ring_specs",
]
