"""Disk for weight transfers: what a node without the model receives, against its free disk."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.decision import RuleCheck
from planner.memory import ModelShape, format_bytes, format_pair

DISK_MARGIN_BYTES = 256 * 1024 * 1024  # left free after a transfer; the agent's fetch keeps it too


@dataclass(frozen=True, slots=True)
class TransferSizes:
    """A model's bytes as stored (not as computed: no float32 upcast), for what nodes receive."""

    shape: ModelShape  # at stored precision
    model_bytes: int  # every file a whole copy holds: weights, config, tokenizer

    @property
    def other_bytes(self) -> int:
        """Files outside the weights (config, tokenizer): every share carries them."""
        return max(self.model_bytes - self.shape.weight_bytes, 0)

    def stage_bytes(self, layers: range, is_first: bool, is_last: bool) -> int:
        """A pipeline stage's share: its layers, the embedding or head where it needs them."""
        shape = self.shape
        weights = shape.layer_bytes * len(layers)
        if is_first:
            weights += shape.embedding_bytes
        if is_last and not (is_first and shape.tied_embeddings):
            weights += shape.output_bytes
        return weights + self.other_bytes

    def rank_bytes(self, world_size: int) -> int:
        """A tp rank's share: its slice of the layers (mlx-lm's Model.shard splits their
        linears; the small norms, counted in, stay whole), the embedding and head whole."""
        shape = self.shape
        layers = shape.weight_bytes - shape.non_layer_bytes
        return shape.non_layer_bytes + math.ceil(layers / world_size) + self.other_bytes


@dataclass(frozen=True, slots=True)
class DiskNeed:
    """One node's transfer: bytes to receive (0 when it holds its part) against its free disk."""

    node_id: str
    what: str  # "the model" or "layers 8-15 + head"
    receive_bytes: int
    free_bytes: int | None  # None: not reported (the coordinator, an agent without a cache)

    @property
    def need_bytes(self) -> int:
        return self.receive_bytes + DISK_MARGIN_BYTES if self.receive_bytes else 0

    @property
    def fits(self) -> bool:
        return self.free_bytes is None or self.need_bytes <= self.free_bytes

    def describe(self) -> str:
        if not self.receive_bytes:
            return f"{self.node_id} holds {self.what}"
        if self.free_bytes is None:
            return f"{self.node_id} receives {self.what} (free disk not reported)"
        need, free = format_pair(self.need_bytes, self.free_bytes)
        if self.fits:
            return f"{self.node_id} receives {self.what}: needs {need}, has {free} free"
        short = format_bytes(self.need_bytes - self.free_bytes)
        return (
            f"{self.node_id} lacks {self.what}: needs {need} of disk to receive it, "
            f"has {free} free (short by {short})"
        )


def disk_check(name: str, needs: Sequence[DiskNeed]) -> RuleCheck:
    """The plan's disk rule: every node holds its part or has the disk to receive it.

    A failing check lists only the nodes short on disk; a passing one lists every node.
    """
    short = [need for need in needs if not need.fits]
    shown = short or needs
    return RuleCheck(name, not short, "; ".join(need.describe() for need in shown))
