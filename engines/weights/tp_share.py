"""One tp rank's share of a checkpoint, as mlx-lm's own `Model.shard` cuts it.

The coordinator asks the model: it builds it lazily (nothing is read), shards it for a
stand-in group of the rank's size and rank, and compares every parameter's shape before
and after. A parameter whose shape changed is sliced along that axis; which indices the
rank keeps is read from a probe (an index ramp sharded the same way), so fused weights
(`segments`) slice as mlx cuts them. Everything else a rank keeps whole.

The rank loads the share with `load_rank_share`: a full-shaped placeholder for each sliced
weight, `Model.shard`, then the slices in their place.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from engines.model.info import WEIGHT_GLOB, _read_header
from engines.weights.subset import RankShare, TensorSlice

log = logging.getLogger(__name__)

METADATA_KEY = "tandem_tp_share"  # in the share's safetensors metadata: what was sliced


class StandInGroup:
    """What `Model.shard` asks of a group (its size and this rank) without joining one."""

    def __init__(self, rank: int, world_size: int) -> None:
        self._rank, self._size = rank, world_size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def rank_slices(model_path: Path, share: RankShare) -> dict[str, TensorSlice]:
    """Checkpoint tensor name -> the slice `share` keeps, for every tensor `Model.shard`
    cuts; a tensor not named is kept whole (norms, the embedding, the head).

    Only tensors stored under their parameter's name and shape are sliced; one the model's
    `sanitize` renames or reshapes travels whole and the rank shards it after loading.
    """
    model, _ = load_model(Path(model_path), lazy=True)
    if not hasattr(model, "shard"):
        return {}
    before = {name: value.shape for name, value in tree_flatten(model.parameters())}
    model.shard(StandInGroup(share.rank, share.world_size))
    after = {name: value.shape for name, value in tree_flatten(model.parameters())}
    axes = {name: _changed_axis(before[name], after[name]) for name in before if name in after}
    cut = {name: axis for name, axis in axes.items() if axis is not None}
    stored = _stored_shapes(model_path)
    slices = {}
    probe, _ = load_model(Path(model_path), lazy=True)
    ramps = [
        (name, _ramp(before[name], axis))
        for name, axis in cut.items()
        if stored.get(name) == tuple(before[name])
    ]
    probe.load_weights(ramps, strict=False)
    probe.shard(StandInGroup(share.rank, share.world_size))
    kept = dict(tree_flatten(probe.parameters()))
    for name, _ramp_array in ramps:
        axis = cut[name]
        line = kept[name][tuple(slice(None) if i == axis else 0 for i in range(len(before[name])))]
        slices[name] = TensorSlice(axis, _runs(line.tolist()))
    log.info(
        "%s of %s: %d of %d tensors sliced", share.describe(), model_path, len(slices), len(stored)
    )
    return slices


def share_metadata(model_path: Path, slices: dict[str, TensorSlice]) -> dict[str, str]:
    """The share file's metadata: each sliced tensor's full shape, for the rank's loader."""
    stored = _stored_shapes(model_path)
    return {METADATA_KEY: json.dumps({name: list(stored[name]) for name in sorted(slices)})}


def load_rank_share(model_path: Path, group: Any) -> tuple[Any, dict]:
    """mlx-lm's model for `group`'s rank: the whole model sharded, or a rank share loaded
    into the sharded model (its slices are what `Model.shard` would keep)."""
    full_shapes = _share_shapes(model_path)
    model, config = load_model(Path(model_path), lazy=True, strict=not full_shapes)
    if not hasattr(model, "shard"):
        raise ValueError(
            f"mlx-lm's {config.get('model_type')!r} model has no tensor-parallel variant "
            "(no Model.shard): use pp or single"
        )
    if not full_shapes:
        model.shard(group)
        return model, config
    weights: dict[str, mx.array] = {}
    for file in sorted(Path(model_path).glob(WEIGHT_GLOB)):
        weights.update(mx.load(str(file)))
    missing = sorted(set(full_shapes) - set(weights))
    if missing:
        raise ValueError(f"{model_path}: the rank share lacks {', '.join(missing[:3])}")
    # Full-shaped stand-ins (never evaluated) so Model.shard builds the sharded layers ...
    model.load_weights(
        [(name, mx.zeros(shape, weights[name].dtype)) for name, shape in full_shapes.items()],
        strict=False,
    )
    model.shard(group)
    # ... whose parameters then take the slices as received.
    sharded = dict(tree_flatten(model.parameters()))
    for name in full_shapes:
        if tuple(sharded[name].shape) != tuple(weights[name].shape):
            raise ValueError(
                f"{model_path}: {name} arrived as {tuple(weights[name].shape)}, rank "
                f"{group.rank()} of {group.size()} runs {tuple(sharded[name].shape)}"
            )
    model.load_weights([(name, weights[name]) for name in full_shapes], strict=False)
    return model, config


def _share_shapes(model_path: Path) -> dict[str, tuple[int, ...]]:
    """The full shapes a rank share's metadata names; empty for a whole model."""
    for file in Path(model_path).glob(WEIGHT_GLOB):
        raw = (_read_header(file).get("__metadata__") or {}).get(METADATA_KEY)
        if raw:
            return {name: tuple(shape) for name, shape in json.loads(raw).items()}
    return {}


def _stored_shapes(model_path: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for file in Path(model_path).glob(WEIGHT_GLOB):
        for name, entry in _read_header(file).items():
            if name != "__metadata__":
                shapes[name] = tuple(int(size) for size in entry["shape"])
    return shapes


def _changed_axis(before: tuple[int, ...], after: tuple[int, ...]) -> int | None:
    changed = [axis for axis, (a, b) in enumerate(zip(before, after, strict=False)) if a != b]
    if len(before) != len(after) or len(changed) > 1:
        raise ValueError(f"Model.shard reshaped a parameter from {before} to {after}")
    return changed[0] if changed else None


def _ramp(shape: tuple[int, ...], axis: int) -> mx.array:
    """An array of `shape` whose value is its index along `axis` (broadcast: no memory)."""
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return mx.broadcast_to(mx.arange(shape[axis], dtype=mx.int32).reshape(view), shape)


def _runs(indices: list[int]) -> tuple[tuple[int, int], ...]:
    """[4, 5, 6, 12, 13] -> ((4, 7), (12, 14))."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][1] == index:
            runs[-1][1] += 1
        else:
            runs.append([index, index + 1])
    return tuple((start, stop) for start, stop in runs)
