"""The batch a plan holds: a full --max-batch of full-context sequences when that fits, else (the
operator left --max-batch unset) the largest batch that does, at least one sequence.

As vLLM sizes its KV pool to the memory it has and llama.cpp splits its context over its slots,
a long context on a small machine is served with fewer sequences at once, not refused; the
requests beyond them wait in the queue. Every plan kind shrinks alike: each node's need counts
`batch` sequences of KV (a pipeline stage its layers' share, a tp rank its heads' share), so
the search only asks whether a batch fits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from errors import PlanError
from planner.decision import RuleCheck
from planner.plan_data import ClusterPlan

BATCH_RULE = "batch capacity"

# One way to plan the model (e.g. computing in float32, or in its own precision) at a batch.
PlanAt = Callable[[int], ClusterPlan]


def plan_batch(ways: Sequence[PlanAt], max_batch: int, shrink: bool) -> ClusterPlan:
    """The first of `ways` whose plan holds a full batch of `max_batch`; when none does and
    `shrink`, the first whose plan holds a smaller batch, at the largest batch that fits, with
    the reason in its decision and checks. Otherwise the last way's refusal: with `shrink`,
    planned for one sequence; without, naming the batch that would fit.

    A larger batch never needs less memory, so the largest fitting batch is found by bisection.
    """
    if not ways:
        raise PlanError("plan_batch needs at least one way to plan the model")
    if max_batch < 1:
        raise PlanError(f"max_batch={max_batch} must be at least 1")
    fulls: list[ClusterPlan] = []
    for way in ways:
        fulls.append(way(max_batch))
        if fulls[-1].refusal is None:
            return fulls[-1]
    full = fulls[-1]  # the model's own way: its refusal is the one to give, as without ways
    if max_batch == 1:
        return full
    for way, refused in zip(ways, fulls, strict=True):
        fitting = _largest_fitting(way, max_batch - 1)
        if fitting is not None:
            if shrink:
                return _shrunk(fitting, refused, max_batch)
            hint = (
                f"; --max-batch {max_batch} was given, {fitting.batch_capacity} would fit "
                "(without --max-batch, serve plans the largest batch that fits)"
            )
            return replace(full, refusal=f"{full.refusal}{hint}")
    if not shrink:
        return full
    one = ways[-1](1)
    if all(fit.fits for fit in one.fits):
        return one  # refused for something other than memory (disk, layer count)
    tokens = one.context_tokens
    return replace(one, refusal=f"{one.refusal}, even with one sequence of {tokens} tokens")


def _largest_fitting(way: PlanAt, most: int) -> ClusterPlan | None:
    """`way`'s plan at the largest batch of 1 .. `most` that fits; None when one does not."""
    best = way(1)
    if best.refusal is not None:
        return None
    low, high = 2, most
    while low <= high:
        middle = (low + high) // 2
        plan = way(middle)
        if plan.refusal is None:
            best, low = plan, middle + 1
        else:
            high = middle - 1
    return best


def _shrunk(fitting: ClusterPlan, full: ClusterPlan, max_batch: int) -> ClusterPlan:
    """`fitting` explained: how many sequences it holds, and why not `max_batch` (`full`'s
    refusal, with the numbers)."""
    capacity = fitting.describe_batch()
    detail = (
        f"{capacity}: a full batch of {max_batch} does not fit ({full.refusal}); more requests "
        "wait in the queue"
    )
    reason = (
        f"{fitting.decision.reason}; {BATCH_RULE}: {capacity} (a full batch of {max_batch} "
        "does not fit)"
    )
    return replace(
        fitting,
        decision=replace(fitting.decision, reason=reason),
        checks=(*fitting.checks, RuleCheck(BATCH_RULE, True, detail)),
        max_batch=max_batch,
    )
