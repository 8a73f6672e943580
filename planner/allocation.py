"""Pipeline layer allocation: contiguous layer ranges per stage, in proportion to node memory."""

from __future__ import annotations

from collections.abc import Sequence

from errors import PlanError

MIN_LAYERS_PER_STAGE = 1


def _validate(total_layers: int, node_memory_bytes: Sequence[int]) -> None:
    if total_layers < 1:
        raise PlanError(f"cannot allocate {total_layers} layers: a model needs at least 1 layer")
    stages = len(node_memory_bytes)
    if stages == 0:
        raise PlanError("cannot allocate layers over 0 stages: give at least one node")
    if stages > total_layers:
        raise PlanError(
            f"cannot split {total_layers} layers over {stages} stages: every stage needs at least "
            f"{MIN_LAYERS_PER_STAGE} layer; use at most {total_layers} nodes"
        )
    for index, memory in enumerate(node_memory_bytes):
        if memory <= 0:
            raise PlanError(
                f"node {index} reports {memory} bytes of memory: every stage needs memory > 0"
            )


def _proportional_counts(total_layers: int, node_memory_bytes: Sequence[int]) -> list[int]:
    """Largest-remainder apportionment, in exact integer arithmetic so it is reproducible."""
    total_memory = sum(node_memory_bytes)
    shares = [divmod(total_layers * memory, total_memory) for memory in node_memory_bytes]
    counts = [whole for whole, _ in shares]
    leftover = total_layers - sum(counts)
    # Largest remainder first; ties go to the earlier node so the result is deterministic.
    by_remainder = sorted(range(len(shares)), key=lambda index: (-shares[index][1], index))
    for index in by_remainder[:leftover]:
        counts[index] += 1
    return counts


def _ensure_minimum(counts: list[int]) -> list[int]:
    """Give every empty stage one layer, taken from the currently largest allocation."""
    counts = list(counts)
    for index, count in enumerate(counts):
        while count < MIN_LAYERS_PER_STAGE:
            donor = max(range(len(counts)), key=lambda other: (counts[other], -other))
            counts[donor] -= 1
            counts[index] += 1
            count = counts[index]
    return counts


def allocate_layers(total_layers: int, node_memory_bytes: Sequence[int]) -> list[range]:
    """Split `total_layers` into contiguous ranges, one per node in node order, sized by memory.

    Raises PlanError when there are no nodes, fewer layers than nodes, or a node without memory.
    """
    _validate(total_layers, node_memory_bytes)
    counts = _ensure_minimum(_proportional_counts(total_layers, node_memory_bytes))
    ranges: list[range] = []
    start = 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges
