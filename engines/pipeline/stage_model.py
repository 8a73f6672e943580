"""One pipeline stage's share of a model: load only its layers and run exactly their forward."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import MODEL_REMAPPING, load_config, load_model

from planner.errors import EngineError

from ..precision import upcast_on_cpu

log = logging.getLogger(__name__)

# mlx-lm architectures (module names under mlx_lm.models) whose forward pass is exactly
# embed_tokens -> layers(h, mask, cache) -> norm -> lm_head | tied embeddings, which is what
# StageModel reproduces. Checked against mlx-lm 0.32.2; "mistral" loads as "llama".
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "olmo2", "internlm3")


class StageModel:
    """The modules one stage needs: its layers, plus embeddings (first) or norm and head (last).

    Built by `load()`; the other layers' weights are never read from disk.
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
        tied_head: bool,
        sliding_window: int | None,
        cache_template: list[Any],
        model_type: str,
        peak_memory_bytes: int,
    ) -> None:
        self.layers = layers
        self.total_layers = total_layers
        self.hidden_size = hidden_size
        self.blocks = blocks
        self.embed_tokens = embed_tokens
        self.norm = norm
        self.head = head
        self.tied_head = tied_head
        self.sliding_window = sliding_window
        self.model_type = model_type
        self.peak_memory_bytes = peak_memory_bytes
        self._cache_template = cache_template

    @property
    def is_first(self) -> bool:
        return self.layers.start == 0

    @property
    def is_last(self) -> bool:
        return self.layers.stop == self.total_layers

    @classmethod
    def load(
        cls, model_path: Path, layers: range, is_last: bool, upcast: bool = False
    ) -> StageModel:
        """Load the weights of `layers` (and the embeddings / head when this stage needs them)."""
        model_path = Path(model_path)
        try:
            model_type = str(load_config(model_path).get("model_type"))
        except (OSError, ValueError) as error:
            raise EngineError(f"cannot read the model config in {model_path}: {error}") from error
        architecture = MODEL_REMAPPING.get(model_type, model_type)
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise EngineError(
                f"model type {model_type!r} ({model_path}) is not supported by the pipeline "
                f"engine; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        mx.reset_peak_memory()
        try:
            model, _ = load_model(model_path, lazy=True)
        except (OSError, ValueError, KeyError) as error:
            raise EngineError(f"cannot load model {model_path}: {error}") from error
        if not _has_llama_layout(model):
            raise EngineError(
                f"model type {model_type!r} ({model_path}) lacks model.embed_tokens / layers / "
                f"norm, which the pipeline engine needs"
            )
        inner = model.model
        total = len(inner.layers)
        if not (0 <= layers.start < layers.stop <= total) or layers.step != 1:
            raise EngineError(
                f"stage layer range [{layers.start}, {layers.stop}) is not inside the model's "
                f"{total} layers ({model_path})"
            )
        if is_last != (layers.stop == total):
            raise EngineError(
                f"stage [{layers.start}, {layers.stop}) is_last={is_last} contradicts the "
                f"model's {total} layers: the last stage ends at layer {total}"
            )
        tied = bool(getattr(model.args, "tie_word_embeddings", False)) or not hasattr(
            model, "lm_head"
        )
        is_first = layers.start == 0
        blocks = [inner.layers[index] for index in layers]
        embed = inner.embed_tokens if (is_first or (is_last and tied)) else None
        norm = inner.norm if is_last else None
        head = (None if tied else model.lm_head) if is_last else None
        cache_template = make_prompt_cache(model)[layers.start : layers.stop]
        kept = [module for module in (*blocks, embed, norm, head) if module is not None]
        # Evaluating only the kept modules reads only their tensors from the safetensors files.
        mx.eval([module.parameters() for module in kept])
        for module in kept:
            upcast_on_cpu(module, upcast)
        hidden_size = int(model.args.hidden_size)
        del model, inner
        stage = cls(
            layers=layers,
            total_layers=total,
            hidden_size=hidden_size,
            blocks=blocks,
            embed_tokens=embed,
            norm=norm,
            head=head,
            tied_head=tied,
            sliding_window=getattr(getattr(blocks[0], "args", None), "sliding_window", None),
            cache_template=cache_template,
            model_type=architecture,
            peak_memory_bytes=int(mx.get_peak_memory()),
        )
        log.info(
            "loaded layers [%d, %d) of %d from %s (%s), peak memory %.1f MB",
            layers.start,
            layers.stop,
            total,
            model_path,
            architecture,
            stage.peak_memory_bytes / 1e6,
        )
        return stage

    def make_cache(self) -> list[Any]:
        """A fresh KV cache for this stage's layers (one sequence; batches.py batches them)."""
        return copy.deepcopy(self._cache_template)

    def embed(self, tokens: mx.array) -> mx.array:
        """Token ids (B, L) -> hidden states (B, L, D); first stage only."""
        if not self.is_first or self.embed_tokens is None:
            raise EngineError(f"stage [{self.layers.start}, {self.layers.stop}) has no embeddings")
        return self.embed_tokens(tokens)

    def forward(self, hidden: mx.array, cache: list[Any]) -> mx.array:
        """Run this stage's layers over hidden states (B, L, D), updating `cache` in place."""
        masks: dict[bool, Any] = {}
        for block, layer_cache in zip(self.blocks, cache, strict=True):
            sliding = bool(getattr(block, "use_sliding", False))
            if sliding not in masks:
                # Same call as the full model; every layer's cache has the same offset (a
                # BatchKVCache also masks each row's left padding).
                if sliding:
                    masks[sliding] = create_attention_mask(
                        hidden, layer_cache, window_size=self.sliding_window
                    )
                else:
                    masks[sliding] = create_attention_mask(hidden, layer_cache)
            hidden = block(hidden, masks[sliding], cache=layer_cache)
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
        logits = out[:, -1, :]  # (B, V)
        if not normalized:
            return logits
        # As mlx-lm's GenerationBatch: samplers see log-probabilities, row by row.
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _has_llama_layout(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm"))
