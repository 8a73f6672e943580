"""Memory tiers (ok / warn / critical): thresholds scaled to a node's size, with hysteresis.

The rule, for a node tandem considers to have `total` bytes (the machine, or less under
--memory-budget):

    warn      when available < clamp(10% of total, min(1 GiB, 25% of total), 16 GiB)
    critical  when available < clamp( 4% of total, min(512 MiB, 10% of total), 6 GiB)

and a node leaves a tier only once available is 25% above that tier's threshold.

Why these numbers: a fraction alone is too little on a small machine (10% of 8 GiB is
800 MiB, about where macOS starts compressing and swapping and Linux nears the OOM killer),
so an absolute floor applies; it is itself capped at a share of the node, or a small node (or
a small budget) would never be ok. On a large machine a fraction alone is far more than one
burst of allocations needs (10% of 512 GiB is 51 GiB), so an absolute ceiling applies: the
warn ceiling of 16 GiB covers the KV cache of a full batch at long context on a large
model, the critical ceiling of 6 GiB a few seconds of prefill activations and one more
sequence. Warn gives the prefix cache back; critical stops new requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

OK = "ok"
WARN = "warn"
CRITICAL = "critical"
TIERS = (OK, WARN, CRITICAL)  # least to most severe

MIB = 1024**2
GIB = 1024**3
WARN_FRACTION = 0.10
WARN_FLOOR = 1 * GIB
WARN_FLOOR_SHARE = 0.25  # the floor never exceeds this share of the node
WARN_CEILING = 16 * GIB
CRITICAL_FRACTION = 0.04
CRITICAL_FLOOR = 512 * MIB
CRITICAL_FLOOR_SHARE = 0.10
CRITICAL_CEILING = 6 * GIB
RECOVERY_FACTOR = 1.25  # leave a tier only with this much more than its threshold: no flapping


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Available bytes below which a node of a given size is in warn, or critical."""

    warn: int
    critical: int


def thresholds_for(total: int) -> Thresholds:
    """The warn and critical thresholds of a node with `total` bytes."""
    return Thresholds(
        warn=_clamp(
            int(total * WARN_FRACTION),
            min(WARN_FLOOR, int(total * WARN_FLOOR_SHARE)),
            WARN_CEILING,
        ),
        critical=_clamp(
            int(total * CRITICAL_FRACTION),
            min(CRITICAL_FLOOR, int(total * CRITICAL_FLOOR_SHARE)),
            CRITICAL_CEILING,
        ),
    )


def classify(available: int, total: int, previous: str = OK) -> str:
    """The tier of a node with `available` of `total` bytes that was in `previous` before."""
    limits = thresholds_for(total)
    if available < limits.critical:
        return CRITICAL
    if previous == CRITICAL and available < limits.critical * RECOVERY_FACTOR:
        return CRITICAL
    if available < limits.warn:
        return WARN
    if previous in (WARN, CRITICAL) and available < limits.warn * RECOVERY_FACTOR:
        return WARN
    return OK


def severity(tier: str) -> int:
    """0 for ok, 1 for warn, 2 for critical; ValueError for anything else."""
    return TIERS.index(tier)


def worst_tier(tiers: Iterable[str]) -> str:
    """The most severe of `tiers`; ok when there are none."""
    return max(tiers, key=severity, default=OK)


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(value, high))
