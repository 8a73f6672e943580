"""Layer allocation: contiguous, proportional to memory, at least one layer per stage."""

from __future__ import annotations

import pytest

from planner import PlanError, allocate_layers

GB = 1024**3


@pytest.mark.parametrize(
    ("total_layers", "memory", "expected"),
    [
        pytest.param(32, [GB, GB], [range(0, 16), range(16, 32)], id="even-2-nodes"),
        pytest.param(
            12, [GB] * 4, [range(0, 3), range(3, 6), range(6, 9), range(9, 12)], id="even-4-nodes"
        ),
        pytest.param(5, [GB] * 3, [range(0, 2), range(2, 4), range(4, 5)], id="uneven-5-over-3"),
        pytest.param(
            32,
            [16 * GB, 8 * GB, 8 * GB],
            [range(0, 16), range(16, 24), range(24, 32)],
            id="heterogeneous-16-8-8-GB",
        ),
        pytest.param(10, [3 * GB, GB], [range(0, 8), range(8, 10)], id="largest-remainder-7.5-2.5"),
        pytest.param(
            4, [100 * GB, GB, GB], [range(0, 2), range(2, 3), range(3, 4)], id="min-one-layer"
        ),
        pytest.param(
            3, [GB, 1000 * GB, GB], [range(0, 1), range(1, 2), range(2, 3)], id="min-one-each"
        ),
        pytest.param(7, [GB], [range(0, 7)], id="single-stage"),
    ],
)
def test_allocate_layers(total_layers: int, memory: list[int], expected: list[range]) -> None:
    assert allocate_layers(total_layers, memory) == expected


@pytest.mark.parametrize(
    ("total_layers", "memory"),
    [
        pytest.param(32, [16 * GB, 8 * GB, 8 * GB], id="heterogeneous"),
        pytest.param(80, [64 * GB, 24 * GB, 36 * GB, 8 * GB, 128 * GB], id="five-macs"),
        pytest.param(5, [1, 2, 3, 4, 5], id="tiny-memories"),
        pytest.param(61, [7, 7, 7], id="prime-layers"),
    ],
)
def test_ranges_are_contiguous_cover_every_layer_and_never_empty(
    total_layers: int, memory: list[int]
) -> None:
    ranges = allocate_layers(total_layers, memory)
    assert len(ranges) == len(memory)
    assert ranges[0].start == 0 and ranges[-1].stop == total_layers
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:], strict=False))
    assert sum(len(r) for r in ranges) == total_layers
    assert all(len(r) >= 1 for r in ranges)


def test_more_memory_never_means_fewer_layers() -> None:
    ranges = allocate_layers(80, [64 * GB, 24 * GB, 36 * GB, 8 * GB, 128 * GB])
    sizes = [len(r) for r in ranges]
    assert sizes[4] > sizes[0] > sizes[2] > sizes[1] > sizes[3]


@pytest.mark.parametrize(
    ("total_layers", "memory", "message"),
    [
        pytest.param(2, [GB, GB, GB], "cannot split 2 layers over 3 stages", id="more-stages"),
        pytest.param(8, [], "0 stages", id="zero-stages"),
        pytest.param(0, [GB], "cannot allocate 0 layers", id="zero-layers"),
        pytest.param(-3, [GB], "cannot allocate -3 layers", id="negative-layers"),
        pytest.param(8, [GB, 0], "node 1 reports 0 bytes", id="zero-memory"),
        pytest.param(8, [-5, GB], "node 0 reports -5 bytes", id="negative-memory"),
    ],
)
def test_allocate_layers_rejects_invalid_input(
    total_layers: int, memory: list[int], message: str
) -> None:
    with pytest.raises(PlanError, match=message):
        allocate_layers(total_layers, memory)
