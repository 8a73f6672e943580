"""One pipeline stage's share of a model: only its layers, run with mlx-lm's own modules."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_config, load_model

from engines.model.gemm_layout import lay_out
from engines.model.kv_quantization import KVQuantization, kv_quantization
from engines.model.layers import StageLayout, apply_softcap, describe, pipeline_problem
from engines.model.packed_quantized import pack
from engines.model.precision import upcast_on_cpu
from engines.model.reference import local_model_path
from engines.weights.manifest import is_partial_copy
from errors import EngineError, ModelError
from planner.memory import DEFAULT_QUANTIZED_KV_START

log = logging.getLogger(__name__)


class StageModel:
    """The modules one stage needs: its layers, plus embeddings (first) or norm and head (last).

    Built by `load()` from mlx-lm's own model class, whatever the architecture (see layout.py
    for what "the usual shape" is and which differences are handled); the other layers'
    weights are never read from disk.
    """

    def __init__(
        self,
        *,
        layers: range,
        total_layers: int,
        hidden_size: int,
        blocks: list[nn.Module],
        embed_tokens: nn.Module | None,
        norm: nn.Module | None,
        head: nn.Module | None,
        layout: StageLayout,
        cache_template: list[Any],
        peak_memory_bytes: int,
        vocab_size: int = 0,
        kv: KVQuantization | None = None,
    ) -> None:
        self.layers = layers
        self.total_layers = total_layers
        self.hidden_size = hidden_size
        self.blocks = blocks
        self.embed_tokens = embed_tokens
        self.norm = norm
        self.head = head
        self.layout = layout
        self.tied_head = layout.tied_head
        self.model_type = layout.architecture
        self.windows = layout.windows[layers.start : layers.stop]
        self.peak_memory_bytes = peak_memory_bytes
        self.vocab_size = vocab_size  # the config's (0 when it names none): the logits' width
        self._cache_template = cache_template
        self.kv = kv  # how its KV caches are quantized; None: they are not

    @property
    def is_first(self) -> bool:
        return self.layers.start == 0

    @property
    def is_last(self) -> bool:
        return self.layers.stop == self.total_layers

    @classmethod
    def load(
        cls,
        model_path: Path,
        layers: range,
        is_last: bool,
        upcast: bool = False,
        kv_bits: int = 0,
        quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    ) -> StageModel:
        """Load the weights of `layers` (and the embeddings / head when this stage needs them);
        `kv_bits` (8 or 4) quantizes its KV caches once they hold `quantized_kv_start` tokens.

        `model_path` is a directory, or repo@commit resolved through this machine's Hugging
        Face cache (what an agent is sent).
        """
        model_path = _pipeline_model_path(model_path)
        mx.reset_peak_memory()
        model, layout = _lazy_model(model_path)
        inner = getattr(model, layout.inner)
        total = len(inner.layers)
        _check_layers(layers, is_last, total, model_path)
        blocks, embed, norm, head = _modules_of(model, layout, layers, is_last)
        kv = kv_quantization(model, kv_bits, quantized_kv_start) if kv_bits else None
        if kv is not None:
            cache_template = kv.make_caches()[layers.start : layers.stop]
        else:
            cache_template = make_prompt_cache(model)[layers.start : layers.stop]
        blocks, embed, head = _read_kept(blocks, embed, norm, head, upcast)
        hidden_size = int(model.args.hidden_size)
        vocab_size = int(getattr(model.args, "vocab_size", 0) or 0)
        del model, inner
        stage = cls(
            layers=layers,
            total_layers=total,
            hidden_size=hidden_size,
            blocks=blocks,
            embed_tokens=embed,
            norm=norm,
            head=head,
            layout=layout,
            cache_template=cache_template,
            peak_memory_bytes=int(mx.get_peak_memory()),
            vocab_size=vocab_size,
            kv=kv,
        )
        log.info(
            "loaded layers [%d, %d) of %d from %s (%s), peak memory %.1f MB",
            layers.start,
            layers.stop,
            total,
            model_path,
            layout.architecture,
            stage.peak_memory_bytes / 1e6,
        )
        return stage

    def make_cache(self) -> list[Any]:
        """A fresh KV cache for this stage's layers (one sequence; batches.py batches them)."""
        return copy.deepcopy(self._cache_template)

    def adopt_cache(self, caches: list[Any]) -> list[Any]:
        """Caches handed in (a prefix-cache entry, from memory or disk) as this stage's kind."""
        return caches if self.kv is None else [self.kv.adopt(cache) for cache in caches]

    def embed(self, tokens: mx.array) -> mx.array:
        """Token ids (B, L) -> hidden states (B, L, D) as the model feeds its first layer."""
        if not self.is_first or self.embed_tokens is None:
            raise EngineError(f"stage [{self.layers.start}, {self.layers.stop}) has no embeddings")
        hidden = self.embed_tokens(tokens)
        if self.layout.embedding_scale is not None:  # gemma: sqrt(hidden size)
            hidden = hidden * mx.array(self.layout.embedding_scale, dtype=hidden.dtype)
        return hidden

    def forward(self, hidden: mx.array, cache: list[Any]) -> mx.array:
        """Run this stage's layers over hidden states (B, L, D), updating `cache` in place."""
        masks: dict[int | None, Any] = {}
        for block, window, layer_cache in zip(self.blocks, self.windows, cache, strict=True):
            if window not in masks:
                # One mask per attention kind, from a cache of that kind, as the model's own
                # forward builds it (every cache of a kind has the same offset). An array,
                # not "causal": every mlx-lm attention accepts one (batched caches always
                # give arrays), some (MLA) accept nothing else.
                masks[window] = create_attention_mask(
                    hidden, layer_cache, window_size=window, return_array=True
                )
            hidden = block(hidden, masks[window], layer_cache)
        return hidden

    def logits(self, hidden: mx.array, normalized: bool = True) -> mx.array:
        """Hidden (B, L, D) -> each row's next-token log-probabilities (B, V), or the raw
        logits when not `normalized` (logits processors need them); last stage only."""
        if self.norm is None:
            raise EngineError(f"stage [{self.layers.start}, {self.layers.stop}) has no output head")
        out = self.norm(hidden)  # (B, L, D)
        if self.tied_head:
            out = self.embed_tokens.as_linear(out)  # (B, L, V)
        else:
            out = self.head(out)
        if self.layout.logit_softcap is not None:  # gemma2
            out = apply_softcap(out, self.layout.logit_softcap)
        logits = out[:, -1, :]  # (B, V)
        if not normalized:
            return logits
        # As mlx-lm's GenerationBatch: samplers see log-probabilities, row by row.
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _pipeline_model_path(model_path: Path) -> Path:
    """The model's local directory, once its config says the pipeline can split it; else
    EngineError, saying why."""
    try:
        model_path = local_model_path(model_path)
    except ModelError as error:
        raise EngineError(str(error)) from error
    try:
        config = load_config(model_path)
    except (OSError, ValueError) as error:
        raise EngineError(f"cannot read the model config in {model_path}: {error}") from error
    problem = pipeline_problem(config)
    if problem:
        raise EngineError(
            f"model type {config.get('model_type')!r} ({model_path}) is not supported by "
            f"the pipeline engine: {problem}"
        )
    return model_path


def _lazy_model(model_path: Path) -> tuple[nn.Module, StageLayout]:
    """mlx-lm's model, its weights not read yet, and its layout."""
    try:
        # A stage's share fetched from the coordinator holds only its own tensors.
        model, _ = load_model(model_path, lazy=True, strict=not is_partial_copy(model_path))
        return model, describe(model)
    except (OSError, ValueError, KeyError, ModelError) as error:
        raise EngineError(f"cannot load model {model_path}: {error}") from error


def _check_layers(layers: range, is_last: bool, total: int, model_path: Path) -> None:
    """EngineError unless `layers` is a stage of the model's `total`, the last one if
    `is_last`."""
    # [0, 0) is a relay's stage 0: the embedding alone, every layer further down the chain
    empty_first = layers == range(0, 0) and not is_last
    if not (empty_first or 0 <= layers.start < layers.stop <= total) or layers.step != 1:
        raise EngineError(
            f"stage layer range [{layers.start}, {layers.stop}) is not inside the model's "
            f"{total} layers ({model_path})"
        )
    if is_last != (layers.stop == total):
        raise EngineError(
            f"stage [{layers.start}, {layers.stop}) is_last={is_last} contradicts the "
            f"model's {total} layers: the last stage ends at layer {total}"
        )


def _modules_of(
    model: nn.Module, layout: StageLayout, layers: range, is_last: bool
) -> tuple[list[nn.Module], nn.Module | None, nn.Module | None, nn.Module | None]:
    """The modules a stage of `layers` keeps: its blocks, the embedding (the first stage's, or
    the last's when the head is tied to it), and the last stage's norm and head."""
    inner = getattr(model, layout.inner)
    blocks = [inner.layers[index] for index in layers]
    embedding = getattr(inner, layout.embedding)
    embed = embedding if (layers.start == 0 or (is_last and layout.tied_head)) else None
    norm = getattr(inner, layout.norm) if is_last else None
    head = model.lm_head if (is_last and not layout.tied_head) else None
    return blocks, embed, norm, head


def _read_kept(
    blocks: list[nn.Module],
    embed: nn.Module | None,
    norm: nn.Module | None,
    head: nn.Module | None,
    upcast: bool,
) -> tuple[list[nn.Module], nn.Module | None, nn.Module | None]:
    """The stage's modules read from disk, upcast when asked, laid out and packed: (blocks,
    embed, head); the norm is kept as read."""
    kept = [module for module in (*blocks, embed, norm, head) if module is not None]
    # Evaluating only the kept modules reads only their tensors from the safetensors files.
    mx.eval([module.parameters() for module in kept])
    for module in kept:
        upcast_on_cpu(module, upcast)
    *blocks, head = pack(*lay_out(*blocks, head))  # every block's shapes timed once
    if embed is not None:
        (embed,) = pack(embed)  # a tied head's product
    return blocks, embed, head
