"""config.json for mlx-lm from a GGUF's metadata: the hyperparameters under `<arch>.*`."""

from __future__ import annotations

from typing import Any

import numpy as np

from engines.model.gguf.architectures import Architecture
from engines.model.gguf.rope import llama3_rope_scaling
from engines.model.gguf.source import GGUFSource
from errors import ModelError

DEFAULT_ROPE_THETA = 10000.0
DEFAULT_RMS_NORM_EPS = 1e-5
# What llama.cpp assumes for Gemma 3 when the file does not say (its loader hard-codes them).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_27B_LAYERS = 62  # llama.cpp scales the 27B's queries by hidden / heads, not head_dim
ROPE_SCALING_TYPES = ("linear", "yarn")
SPECIAL_TOKEN_KEYS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}


def build_config(source: GGUFSource, architecture: Architecture) -> dict[str, Any]:
    """The config.json mlx-lm needs to build `architecture`'s model from this GGUF."""
    key = _keys(architecture.gguf_name)
    embedding = source.tensors["token_embd.weight"]
    hidden = int(source.value(key("embedding_length")))
    heads = _per_layer_constant(source, key("attention.head_count"))
    kv_heads = _per_layer_constant(source, key("attention.head_count_kv"), heads)
    head_dim = int(source.value(key("attention.key_length"), hidden // heads))
    config: dict[str, Any] = {
        "model_type": architecture.model_type,
        "architectures": [architecture.class_name],
        "hidden_size": hidden,
        "intermediate_size": _per_layer_constant(source, key("feed_forward_length"), 0),
        "num_hidden_layers": int(source.value(key("block_count"))),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": int(embedding.shape[-1]),  # rows of the embedding (GGUF shapes are reversed)
        "max_position_embeddings": int(source.value(key("context_length"))),
        "rms_norm_eps": float(
            source.value(key("attention.layer_norm_rms_epsilon"), DEFAULT_RMS_NORM_EPS)
        ),
        "rope_theta": float(source.value(key("rope.freq_base"), DEFAULT_ROPE_THETA)),
        "tie_word_embeddings": "output.weight" not in source.tensors,
    }
    config.update(_special_token_ids(source, config["vocab_size"]))
    if "blk.0.attn_q.bias" in source.tensors:
        config["attention_bias"] = True
    if scaling := _rope_scaling(source, key):
        config["rope_scaling"] = scaling
    if "rope_freqs.weight" in source.tensors:
        config["rope_scaling"] = llama3_rope_scaling(source, key, config)
    extra = EXTRAS.get(architecture.gguf_name)
    if extra is not None:
        config.update(extra(source, key, config))
    return config


def _special_token_ids(source: GGUFSource, vocab_size: int) -> dict[str, int]:
    """bos/eos/pad ids (transformers otherwise assumes its own defaults for some families)."""
    ids = {}
    for name, key in SPECIAL_TOKEN_KEYS.items():
        value = source.value(key, -1)
        if 0 <= int(value) < vocab_size:
            ids[name] = int(value)
    return ids


def _keys(architecture: str):
    return lambda name: f"{architecture}.{name}"


def _per_layer_constant(source: GGUFSource, name: str, default: int | None = None) -> int:
    """A count the GGUF may store per layer (a list): one value, or a ModelError."""
    value = source.value(name, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelError(f"{source.paths[0]}: {name} differs between layers ({value})")
        value = value[0]
    return int(value)


def _rope_scaling(source: GGUFSource, key) -> dict[str, Any] | None:
    kind = source.value(key("rope.scaling.type"), "none")
    if kind == "none":
        return None
    if kind not in ROPE_SCALING_TYPES:
        raise ModelError(f"{source.paths[0]}: RoPE scaling {kind!r} is not supported")
    scaling: dict[str, Any] = {
        "rope_type": kind,
        "factor": float(source.value(key("rope.scaling.factor"))),
    }
    if source.has(key("rope.scaling.original_context_length")):
        original = int(source.value(key("rope.scaling.original_context_length")))
        scaling["original_max_position_embeddings"] = original
    return scaling


def _qwen3moe(source: GGUFSource, key, config: dict[str, Any]) -> dict[str, Any]:
    layers = config["num_hidden_layers"]
    # A layer without a router is a dense MLP (llama.cpp's own models route every layer).
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in source.tensors]
    return {
        "num_experts": int(source.value(key("expert_count"))),
        "num_experts_per_tok": int(source.value(key("expert_used_count"))),
        "moe_intermediate_size": int(source.value(key("expert_feed_forward_length"))),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "norm_topk_prob": bool(source.value(key("expert_weights_norm"), True)),
    }


def _gemma3(source: GGUFSource, key, config: dict[str, Any]) -> dict[str, Any]:
    layers = config["num_hidden_layers"]
    scalar = config["head_dim"]
    if layers == GEMMA3_27B_LAYERS:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    scaling = config.pop("rope_scaling", None)
    return {
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(source.value(key("attention.sliding_window"))),
        "sliding_window_pattern": _sliding_window_pattern(source, key, layers),
        "rope_local_base_freq": float(
            source.value(key("rope.freq_base_swa"), GEMMA3_LOCAL_ROPE_THETA)
        ),
        "rope_scaling": scaling,
    }


def _sliding_window_pattern(source: GGUFSource, key, layers: int) -> int:
    """mlx-lm's period: every n-th layer global. The GGUF stores a period or a flag a layer."""
    value = source.value(key("attention.sliding_window_pattern"), GEMMA3_SLIDING_WINDOW_PATTERN)
    if not isinstance(value, list):
        return int(value)
    windowed = [bool(flag) for flag in value]
    for period in range(1, layers + 1):
        if windowed == [i % period != period - 1 for i in range(layers)]:
            return period
    raise ModelError(f"{source.paths[0]}: sliding-window layers {windowed} have no period")


def _phi3(source: GGUFSource, key, config: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    rotary = int(source.value(key("rope.dimension_count"), config["head_dim"]))
    if rotary != config["head_dim"]:
        extra["partial_rotary_factor"] = rotary / config["head_dim"]
    long = source.tensors.get("rope_factors_long.weight")
    if long is not None:
        short = source.tensors["rope_factors_short.weight"]
        extra["rope_scaling"] = {
            "type": "longrope",
            "long_factor": np.asarray(long.data, dtype=np.float32).tolist(),
            "short_factor": np.asarray(short.data, dtype=np.float32).tolist(),
        }
        original = source.value(key("rope.scaling.original_context_length"), 0)
        if original:
            extra["original_max_position_embeddings"] = int(original)
    return extra


EXTRAS = {"qwen3moe": _qwen3moe, "gemma3": _gemma3, "phi3": _phi3}
