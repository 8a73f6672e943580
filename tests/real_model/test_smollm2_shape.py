"""SmolLM2-135M-Instruct's shape in the planner: 9 heads over 3 KV heads, so two ranks cannot
split them (tp=2 fails closed to single) and three can. That real weights give mlx-lm's own
greedy tokens over a pipeline and a tp ring is Qwen2.5-Coder's part (tests/real_coder)."""

from __future__ import annotations

from pathlib import Path

from engines.model.info import inspect_model
from planner import NodeResources, Parallelism, plan_cluster

GIB = 1024**3


def test_tp_over_two_ranks_fails_closed_to_single_and_three_ranks_split(
    smollm2_dir: Path,
) -> None:
    shape = inspect_model(smollm2_dir).to_shape()
    nodes = [
        NodeResources(f"node{rank}", f"10.0.0.{rank + 1}", 8 * GIB, ("ring",)) for rank in range(3)
    ]
    two = plan_cluster(Parallelism.TP, shape, nodes[:2], collective="ring")
    assert (two.decision.chosen, two.decision.failed_closed) == (Parallelism.SINGLE, True)
    assert "attention heads 9 do not divide evenly across worldSize=2" in two.decision.reason
    assert "KV heads 3 do not divide evenly across worldSize=2" in two.decision.reason
    three = plan_cluster(Parallelism.TP, shape, nodes, collective="ring")
    assert (three.decision.chosen, three.refusal) == (Parallelism.TP, None)
