"""The memory model: bytes a model needs on one node, per tp rank, or per pipeline stage."""

from __future__ import annotations

import math
from dataclasses import dataclass

from errors import PlanError

DEFAULT_HEADROOM = 0.10
DEFAULT_CONTEXT_TOKENS = 4096
DEFAULT_MAX_BATCH = 16  # sequences decoded together (--max-batch)
BYTE_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")
# RAM is sold and reported in powers of two ("16 GB" = 16 * 2**30), so scale by 1024.
UNIT_STEP = 1024
KV_BITS = (4, 8)  # the KV cache quantizations engines offer (--kv-bits); 0 means none
# A sequence's KV is quantized once it holds this many tokens (--quantized-kv-start), as
# mlx_lm.server's default: shorter ones stay in full precision.
DEFAULT_QUANTIZED_KV_START = 5000
PACKED_BITS = 32  # mx.quantize packs the quantized values into uint32 words


def quantizes_at(length: int, start: int) -> bool:
    """Whether a forward pass leaving a sequence's KV cache at `length` tokens quantizes it,
    as mlx-lm's maybe_quantize_kv_cache after every pass (`offset >= quantized_kv_start`)."""
    return length > 0 and length >= start


def kv_group_size(head_dim: int) -> int:
    """Values sharing one scale and bias in a quantized KV vector: 64 when the head size
    allows it, else 32 (mx.quantize's group sizes must divide the head)."""
    for group_size in (64, 32):
        if head_dim % group_size == 0:
            return group_size
    raise PlanError(f"a quantized KV cache needs a head size divisible by 32, got {head_dim}")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes of a model the planner needs: layer count, heads, and where its bytes live."""

    num_layers: int
    hidden_size: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    weight_bytes: int  # every parameter, embeddings and output head included
    embedding_bytes: int
    head_bytes: int  # the output projection; ignored when tied to the embedding
    tied_embeddings: bool
    dtype_bytes: int
    has_tp_variant: bool
    intermediate_size: int = 0  # MLP width (0 when unknown): tp splits it too
    pipeline_problem: str = ""  # why the pipeline engine cannot split it; "" when it can
    kv_bits: int = 0  # the KV cache's quantization (one of KV_BITS); 0: the compute dtype
    # with kv_bits: a sequence's KV is quantized once it holds this many tokens, full precision
    # until then (--quantized-kv-start)
    quantized_kv_start: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "attention_heads", "kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise PlanError(f"model shape {name}={getattr(self, name)} must be at least 1")
        for name in ("weight_bytes", "embedding_bytes", "head_bytes"):
            if getattr(self, name) < 0:
                raise PlanError(f"model shape {name}={getattr(self, name)} must not be negative")
        if self.kv_bits and self.kv_bits not in KV_BITS:
            raise PlanError(f"KV cache bits must be one of {KV_BITS} or 0, got {self.kv_bits}")
        if self.kv_bits:
            kv_group_size(self.head_dim)  # a head size quantization cannot group is refused
        if self.quantized_kv_start < 0:
            raise PlanError(f"quantized_kv_start={self.quantized_kv_start} must not be negative")
        if self.weight_bytes < self.non_layer_bytes:
            raise PlanError(
                f"model shape weight_bytes={self.weight_bytes} is smaller than its embedding "
                f"and head ({self.non_layer_bytes} bytes); check the model's size fields"
            )

    @property
    def non_layer_bytes(self) -> int:
        """The embedding plus, when untied, the output head: the bytes outside the layers."""
        return self.embedding_bytes + (0 if self.tied_embeddings else self.head_bytes)

    @property
    def layer_bytes(self) -> int:
        """Weight bytes of one transformer layer (layers are assumed equal in size)."""
        return (self.weight_bytes - self.non_layer_bytes) // self.num_layers

    @property
    def full_kv_bytes_per_token_per_layer(self) -> int:
        """One K and one V vector per KV head, per token, per layer, in the compute dtype."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """One K and one V vector per KV head, per token, per layer; quantized, each vector
        is its packed values plus a scale and a bias (compute dtype) per group."""
        if not self.kv_bits:
            return self.full_kv_bytes_per_token_per_layer
        groups = self.head_dim // kv_group_size(self.head_dim)
        packed = self.head_dim * self.kv_bits // PACKED_BITS * (PACKED_BITS // 8)
        return 2 * self.kv_heads * (packed + 2 * groups * self.dtype_bytes)

    def sequence_kv_bytes_per_layer(self, tokens: int) -> int:
        """The most KV one layer holds for a sequence of up to `tokens` tokens. Quantized from
        quantized_kv_start on, counted as its first `start` tokens in full precision and the
        rest quantized: a sequence under the threshold is all full precision, one past it all
        quantized (mlx-lm quantizes every token it holds then), and this covers both."""
        below = min(tokens, self.quantized_kv_start) if self.kv_bits else tokens
        full, quantized = self.full_kv_bytes_per_token_per_layer, self.kv_bytes_per_token_per_layer
        return below * full + (tokens - below) * quantized

    @property
    def prefix_kv_bytes_per_token(self) -> int:
        """KV bytes of one prefix-cache token over every layer. An entry holds what its
        sequence's cache held: with a quantized_kv_start, priced as one under it (the usual
        prompt), full precision."""
        per_layer = (
            self.full_kv_bytes_per_token_per_layer
            if self.quantized_kv_start
            else self.kv_bytes_per_token_per_layer
        )
        return per_layer * self.num_layers

    @property
    def output_bytes(self) -> int:
        """What the last pipeline stage holds to produce logits: the head, or a tied copy."""
        return self.embedding_bytes if self.tied_embeddings else self.head_bytes


@dataclass(frozen=True, slots=True)
class NodeFit:
    """How much one node needs for its share of the model against what it has."""

    node_id: str
    need_bytes: int
    available_bytes: int
    bound: str = ""  # what caps available_bytes below the machine's memory ("" for none)

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.available_bytes

    def describe(self) -> str:
        need, has = format_pair(self.need_bytes, self.available_bytes)
        return f"{self.node_id}: needs {need}, has {has}{bounded(self.bound)}"


def bounded(bound: str) -> str:
    """' (cgroup v1 limit)' after a node's memory when something caps it, else ''."""
    return f" ({bound})" if bound else ""


def byte_unit(n: int) -> str:
    """The largest unit in which `n` is at least 1, e.g. 1536 -> "KB"."""
    value, unit = float(abs(n)), 0
    while value >= UNIT_STEP and unit < len(BYTE_UNITS) - 1:
        value /= UNIT_STEP
        unit += 1
    return BYTE_UNITS[unit]


def format_bytes(n: int, unit: str | None = None) -> str:
    """Human-readable size, e.g. 1288490188 -> "1.2 GB"; pass `unit` to compare two sizes."""
    unit = unit or byte_unit(n)
    if unit not in BYTE_UNITS:
        raise PlanError(f"unknown byte unit {unit!r}; expected one of {list(BYTE_UNITS)}")
    if unit == "B":
        return f"{n} B"
    return f"{n / UNIT_STEP ** BYTE_UNITS.index(unit):.1f} {unit}"


def format_pair(first: int, second: int) -> tuple[str, str]:
    """Two sizes in the same unit (the larger one's), so "1.2 MB vs 0.9 MB" reads at a glance."""
    unit = byte_unit(max(abs(first), abs(second)))
    if min(abs(first), abs(second)) * 100 < max(abs(first), abs(second)):
        return format_bytes(first), format_bytes(second)  # "0.0 GB" would hide the small one
    return format_bytes(first, unit), format_bytes(second, unit)


def _with_headroom(raw_bytes: int, context_tokens: int, headroom: float) -> int:
    if context_tokens < 0:
        raise PlanError(f"context_tokens={context_tokens} must not be negative")
    if headroom < 0:
        raise PlanError(f"headroom={headroom} must not be negative (0.10 means 10% extra)")
    # Headroom covers activations, the runtime and allocator slack on top of weights and cache.
    return math.ceil(raw_bytes * (1.0 + headroom))


def _kv_bytes(shape: ModelShape, layer_count: int, context_tokens: int) -> int:
    return shape.kv_bytes_per_token_per_layer * layer_count * context_tokens


def single_need(
    shape: ModelShape,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    headroom: float = DEFAULT_HEADROOM,
) -> int:
    """Bytes one node needs to hold the whole model and a full-context KV cache."""
    raw = shape.weight_bytes + _kv_bytes(shape, shape.num_layers, context_tokens)
    return _with_headroom(raw, context_tokens, headroom)


def tp_need_per_rank(
    shape: ModelShape,
    world_size: int,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    headroom: float = DEFAULT_HEADROOM,
) -> int:
    """Bytes each tp rank needs: an equal share of the layers and KV cache.

    mlx-lm's Model.shard() splits the attention and MLP linears only, so the embedding and
    the output head stay whole on every rank; counting them in full errs on the safe side.
    """
    if world_size < 1:
        raise PlanError(f"tp needs worldSize >= 1, got worldSize={world_size}")
    layers = shape.weight_bytes - shape.non_layer_bytes
    kv = _kv_bytes(shape, shape.num_layers, context_tokens)
    raw = shape.non_layer_bytes + math.ceil((layers + kv) / world_size)
    return _with_headroom(raw, context_tokens, headroom)


def stage_need(
    shape: ModelShape,
    layers: range,
    is_first: bool,
    is_last: bool,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    headroom: float = DEFAULT_HEADROOM,
) -> int:
    """Bytes one pipeline stage needs for its layers, their KV cache, and its ends of the model.

    The first stage embeds tokens; the last produces logits, so it holds the output head, or
    its own copy of the embedding when the two are tied. A lone stage holds a tied one once.
    """
    raw = shape.layer_bytes * len(layers) + _kv_bytes(shape, len(layers), context_tokens)
    if is_first:
        raw += shape.embedding_bytes
    if is_last and not (is_first and shape.tied_embeddings):
        raw += shape.output_bytes
    return _with_headroom(raw, context_tokens, headroom)
