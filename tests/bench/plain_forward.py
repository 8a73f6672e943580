"""The ceiling without tandem: mlx-lm's model forward alone, one machine or sharded over plain
`mx.distributed`, timed per decode step.

    python -m tests.bench.plain_forward MODEL_DIR BATCH [BATCH ...]

Started with `MLX_RANK` + `MLX_HOSTFILE` (the ring backend's variables, as `mlx.launch` sets
them) on every machine it joins a group and runs `Model.shard(group)`, as a tp rank does, with
nothing else: no scheduler, no lockstep broadcast, no sampling, no HTTP. Without them it runs the
whole model. Prints one JSON line: {"rank", "world_size", "ms_per_step": {batch: median}}.
bench_scaling.py reads it beside what tandem serves on the same lab machines.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import engines  # noqa: F401  (an optimized BLAS under mlx: imported before mlx, which main() loads)

PROMPT_TOKENS = 16
WARM_UP, STEPS = 10, 40


def ms_per_step(model, batch: int) -> float:
    """Median ms of one decode step of `batch` rows, after a short prompt, KV cache growing."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5] * PROMPT_TOKENS] * batch), cache=cache))
    token = mx.array([[7]] * batch)
    times = []
    for _ in range(WARM_UP + STEPS):
        started = time.perf_counter()
        mx.eval(model(token, cache=cache))
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times[WARM_UP:])


def main() -> None:
    import mlx.core as mx
    from mlx_lm import load

    model_dir, batches = sys.argv[1], [int(value) for value in sys.argv[2:]]
    group = None
    if "MLX_HOSTFILE" in os.environ:  # a rank of a plain ring group
        group = mx.distributed.init(backend="ring", strict=True)
    model, _ = load(model_dir, lazy=True)
    if group is not None and group.size() > 1:
        model.shard(group)
    mx.eval(model.parameters())
    steps = {batch: round(ms_per_step(model, batch), 2) for batch in batches}
    print(json.dumps({
        "rank": group.rank() if group else 0,
        "world_size": group.size() if group else 1,
        "ms_per_step": steps,
    }), flush=True)


if __name__ == "__main__":
    main()
