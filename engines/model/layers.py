"""An mlx-lm model's parts for splitting it by layers: embedding, layers, norm, head, masks."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from errors import ModelError

# Where the usual mlx-lm model keeps its parts: Model.<inner>.<embedding|layers|norm>, and
# Model.lm_head unless the head is tied to the embedding.
INNER_NAMES = ("model", "transformer", "backbone")
EMBEDDING_NAMES = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings")
NORM_NAMES = ("norm", "ln_f", "final_layernorm", "norm_f")
HEAD_NAME = "lm_head"


def _bfloat16_rounded(value: float) -> float:
    return float(mx.array(value, mx.bfloat16).astype(mx.float32).item())


# Architectures (mlx-lm module names) whose forward scales the embeddings before the first
# layer; the pipeline's first stage applies the same factor. Checked against mlx-lm 0.32.2.
EMBEDDING_SCALES: dict[str, Callable[[Any], float]] = {
    "gemma": lambda args: args.hidden_size**0.5,
    "gemma2": lambda args: args.hidden_size**0.5,
    # gemma3 rounds the factor to bfloat16 before applying it, whatever the compute dtype.
    "gemma3_text": lambda args: _bfloat16_rounded(args.hidden_size**0.5),
}
# Architectures whose forward does something between the layers and the head, or before the
# first layer, that the pipeline does not reproduce: refused by name instead of run wrongly.
UNSUPPORTED: dict[str, str] = {
    "granite": "scales embeddings and logits by config multipliers",
    "granitemoe": "scales embeddings and logits by config multipliers",
    "minicpm": "scales embeddings and logits by config factors",
    "cohere": "scales logits and runs attention and MLP in parallel off one norm",
    "cohere2": "scales logits",
    "gemma3n": "feeds per-layer inputs and AltUp predictions between layers",
    "llama4_text": "uses chunked attention with per-layer RoPE switches",
    "olmo_hybrid": "mixes recurrent layers",
}


@dataclass(frozen=True, slots=True)
class StageLayout:
    """The facts a pipeline stage needs about one mlx-lm model instance.

    `windows[i]` is layer i's sliding-attention window, or None for global attention: read
    from the cache the model class builds for that layer (a RotatingKVCache of max_size W
    means a window of W), as the model's own forward masks it.
    """

    architecture: str  # the mlx-lm module implementing the model, e.g. "gemma3_text"
    inner: str
    embedding: str
    norm: str
    tied_head: bool
    windows: tuple[int | None, ...]
    embedding_scale: float | None
    logit_softcap: float | None


def architecture_of(model: nn.Module) -> str:
    """The mlx-lm module that implements `model`, e.g. 'llama' (mistral loads as llama)."""
    return type(model).__module__.rsplit(".", 1)[-1]


def describe(model: nn.Module) -> StageLayout:
    """The stage layout of an mlx-lm model (weights may be lazy); ModelError says what is off."""
    architecture = architecture_of(model)
    if architecture in UNSUPPORTED:
        raise ModelError(
            f"the pipeline engine cannot split {architecture!r} models: the model "
            f"{UNSUPPORTED[architecture]}"
        )
    inner_name = _first_child(model, INNER_NAMES)
    inner = getattr(model, inner_name, None) if inner_name else None
    if inner is None:
        raise ModelError(f"{architecture!r} has no inner model ({'/'.join(INNER_NAMES)})")
    embedding = _first_child(inner, EMBEDDING_NAMES)
    norm = _first_child(inner, NORM_NAMES)
    layers = getattr(inner, "layers", None)
    if embedding is None or norm is None or not isinstance(layers, list) or not layers:
        raise ModelError(
            f"{architecture!r} lacks the embedding / layers / final norm the pipeline drives"
        )
    for index, block in enumerate(layers):
        problem = _call_problem(block)
        if problem:
            raise ModelError(f"{architecture!r} layer {index} {problem}")
    args = getattr(model, "args", None)
    scale = EMBEDDING_SCALES.get(architecture)
    softcap = getattr(args, "final_logit_softcapping", None)
    return StageLayout(
        architecture=architecture,
        inner=inner_name,
        embedding=embedding,
        norm=norm,
        tied_head=not isinstance(getattr(model, HEAD_NAME, None), nn.Module),
        windows=_windows(model, architecture, len(layers)),
        embedding_scale=scale(args) if scale else None,
        logit_softcap=float(softcap) if softcap else None,
    )


def pipeline_problem(config: dict[str, Any]) -> str:
    """Why the pipeline engine cannot run the model `config` describes ('' when it can).

    Builds mlx-lm's model class from the config (no weights are read; mlx allocates lazily).
    """
    from mlx_lm.utils import _get_classes

    try:
        model_class, args_class = _get_classes(config)
        architecture = model_class.__module__.rsplit(".", 1)[-1]
        if architecture in UNSUPPORTED:
            return (
                f"the pipeline engine cannot split {architecture!r} models: the model "
                f"{UNSUPPORTED[architecture]}"
            )
        describe(model_class(args_class.from_dict(config)))
    except ModelError as error:
        return str(error)
    except (ValueError, TypeError, KeyError, AttributeError, AssertionError) as error:
        return f"mlx-lm cannot build the model to inspect it: {error}"
    return ""


def _first_child(module: nn.Module, names: tuple[str, ...]) -> str | None:
    for name in names:
        if isinstance(getattr(module, name, None), nn.Module):
            return name
    return None


def _call_problem(block: nn.Module) -> str:
    """'' when the layer is called as layer(hidden, mask, cache) like the usual mlx-lm block."""
    try:
        parameters = list(inspect.signature(block.__call__).parameters.values())
    except (TypeError, ValueError):
        return "has no inspectable __call__"
    required = [
        p
        for p in parameters[3:]
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if len(parameters) < 3 or required:
        names = ", ".join(p.name for p in parameters)
        return f"is called as ({names}), not (hidden, mask, cache)"
    return ""


def _windows(model: nn.Module, architecture: str, count: int) -> tuple[int | None, ...]:
    caches = make_prompt_cache(model)
    if len(caches) != count:
        raise ModelError(
            f"{architecture!r} builds {len(caches)} caches for {count} layers: layers share "
            "or skip caches, which the pipeline cannot split"
        )
    windows: list[int | None] = []
    for index, cache in enumerate(caches):
        if type(cache) is RotatingKVCache:
            windows.append(int(cache.max_size))
        elif type(cache) is KVCache:
            windows.append(None)
        else:
            raise ModelError(
                f"{architecture!r} layer {index} keeps a {type(cache).__name__}, not a KV cache "
                "(recurrent or chunked state): the pipeline cannot carry it"
            )
    return tuple(windows)


def apply_softcap(logits: mx.array, cap: float) -> mx.array:
    """gemma2's final-logit soft cap: cap * tanh(logits / cap)."""
    return mx.tanh(logits / cap) * cap
