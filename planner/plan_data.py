"""The planner's input and its answer as plain data: each member's resources as discovery reports
them, one pipeline stage's layers and memory fit, and the ClusterPlan that says what runs where
and which rules led there. Kept apart from the planning itself (cluster_plan.py), so that whoever
reads, prints or sends a plan does not depend on how it was made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.decision import Decision, RuleCheck
from planner.memory import NodeFit, format_bytes, format_pair
from planner.speed import Prediction


@dataclass(frozen=True, slots=True)
class NodeResources:
    """One cluster member as discovery reports it; list order is rank order, 0 coordinates."""

    node_id: str
    address: str
    memory_bytes: int
    backends: tuple[str, ...]  # collective backends it can join, e.g. ("jaccl", "ring")
    # For weight transfers (planner/disk.py): free bytes of its model cache (None: not
    # reported, not checked), whether it holds a verified whole copy of this model, the
    # [start, stop) layer ranges of the pipeline shares of it that it holds, and the
    # (rank, world size) of the tp shares of it that it holds.
    disk_free_bytes: int | None = None
    holds_model: bool = False
    held_stages: tuple[tuple[int, int], ...] = ()
    held_ranks: tuple[tuple[int, int], ...] = ()
    # What caps memory_bytes below the machine's own memory ("cgroup v1 limit", "--memory-limit"),
    # named in the plan's messages; "" for the machine itself.
    memory_bound: str = ""


@dataclass(frozen=True, slots=True)
class StageAssignment:
    """The contiguous layer range one node runs as a pipeline stage, and its memory fit."""

    node_id: str
    layers: range
    need_bytes: int
    available_bytes: int

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.available_bytes


@dataclass(frozen=True, slots=True)
class ClusterPlan:
    """What will run where, every rule that led there, and a refusal when it does not fit."""

    decision: Decision
    checks: tuple[RuleCheck, ...]
    ranks: tuple[str, ...]  # node ids in rank order (tp, pp) or the coordinator alone (single)
    stages: tuple[StageAssignment, ...]  # pp only
    fits: tuple[NodeFit, ...]
    refusal: str | None = None
    backend: str | None = None  # the collective tp ranks join; None unless tp
    batch_capacity: int = 1  # sequences decoded together, each with a full context of KV
    # The batch asked for (--max-batch); batch_capacity is smaller when that many did not fit
    # and the operator left --max-batch unset (planner/batch.py).
    max_batch: int = 1
    context_tokens: int = 0  # the KV budget of one sequence
    compute_dtype: str = "as stored"  # "float32" when half-precision weights are upcast
    prefix_cache_bytes: int = 0  # KV kept for reuse, whole model; each node holds its share
    kv_bits: int = 0  # the KV cache's quantization (--kv-bits); 0: the compute dtype
    kv_bytes_per_token: int = 0  # KV of one token over every layer, as the plan counts it
    quantized_kv_start: int = 0  # with kv_bits: a sequence's KV is quantized from this length
    full_kv_bytes_per_token: int = 0  # ... and until then, full precision, this per token
    # From measured speeds (planner/speed.py): this plan's prediction first, then every other
    # candidate auto weighed; () when the members' speeds were not measured.
    predictions: tuple[Prediction, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; layer ranges become [start, stop]."""
        return {
            "decision": {
                "chosen": self.decision.chosen.value,
                "reason": self.decision.reason,
                "failed_closed": self.decision.failed_closed,
            },
            "checks": [
                {"name": check.name, "passed": check.passed, "detail": check.detail}
                for check in self.checks
            ],
            "ranks": list(self.ranks),
            "batch_capacity": self.batch_capacity,
            "max_batch": self.max_batch,
            "context_tokens": self.context_tokens,
            "compute_dtype": self.compute_dtype,
            "prefix_cache_bytes": self.prefix_cache_bytes,
            "kv_bits": self.kv_bits,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "quantized_kv_start": self.quantized_kv_start,
            "full_kv_bytes_per_token": self.full_kv_bytes_per_token,
            "stages": [
                {
                    "node_id": stage.node_id,
                    "layers": [stage.layers.start, stage.layers.stop],
                    "need_bytes": stage.need_bytes,
                    "available_bytes": stage.available_bytes,
                    "fits": stage.fits,
                }
                for stage in self.stages
            ],
            "fits": [
                {
                    "node_id": fit.node_id,
                    "need_bytes": fit.need_bytes,
                    "available_bytes": fit.available_bytes,
                    "fits": fit.fits,
                }
                for fit in self.fits
            ],
            "refusal": self.refusal,
            "backend": self.backend,
            "predictions": [prediction.to_dict() for prediction in self.predictions],
        }

    def describe_batch(self) -> str:
        """'3 sequences x 49152 tokens': what the batch holds at once."""
        plural = "" if self.batch_capacity == 1 else "s"
        return f"{self.batch_capacity} sequence{plural} x {self.context_tokens} tokens"

    def describe(self) -> list[str]:
        """Human lines for `tandem plan`: rules, the choice and why, then who runs what."""
        lines = [f"{'PASS' if c.passed else 'FAIL'} {c.name}: {c.detail}" for c in self.checks]
        closed = " [failed closed]" if self.decision.failed_closed else ""
        lines.append(f"chosen: {self.decision.chosen.value}{closed} ({self.decision.reason})")
        if self.backend is not None:
            lines.append(f"collective backend: {self.backend}")
        lines.append(
            f"batch capacity: {self.describe_batch()} of KV cache, counted in every node's need"
            + (
                f" (a full batch of {self.max_batch} does not fit; more requests wait their turn)"
                if self.batch_capacity < self.max_batch
                else ""
            )
        )
        lines.append(f"compute precision on every node: {self.compute_dtype}")
        if self.kv_bytes_per_token:
            bits = f"{self.kv_bits}-bit" if self.kv_bits else "unquantized"
            kv = f"KV cache: {bits}, {format_bytes(self.kv_bytes_per_token)} per token"
            if self.kv_bits and self.quantized_kv_start:
                kv += (
                    f" once a sequence holds {self.quantized_kv_start} tokens; under that "
                    f"unquantized, {format_bytes(self.full_kv_bytes_per_token)} per token"
                )
            lines.append(kv)
        cache = format_bytes(self.prefix_cache_bytes) if self.prefix_cache_bytes else "off"
        per_cached = self.full_kv_bytes_per_token if self.quantized_kv_start else 0
        per_cached = per_cached or self.kv_bytes_per_token
        if self.prefix_cache_bytes and per_cached:
            cache += f" (~{self.prefix_cache_bytes // per_cached} tokens)"
        lines.append(f"prefix cache: {cache} of KV (each node its share, counted in its need)")
        if self.stages:
            for index, stage in enumerate(self.stages):
                first, last = stage.layers.start, stage.layers.stop - 1
                need, has = format_pair(stage.need_bytes, stage.available_bytes)
                lines.append(
                    f"stage {index} {stage.node_id}: layers {first}-{last} "
                    f"({len(stage.layers)} layers), needs {need}, has {has}"
                )
        else:
            for rank, fit in enumerate(self.fits):
                lines.append(f"rank {rank} {fit.describe()}")
        for index, prediction in enumerate(self.predictions):
            lines.append(f"{'predicted' if index == 0 else 'candidate'}: {prediction.describe()}")
        if self.refusal is not None:
            lines.append(f"refused: {self.refusal}")
        return lines
