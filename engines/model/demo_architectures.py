"""Demo models for more mlx-lm architectures: their configs, and seeded weights by parameter name.

llama and qwen3 keep their hand-written generator in demo_model.py (byte-identical files for
existing specs). Every other architecture here takes its parameter names and shapes from
mlx-lm's own Model class built from the demo config, so the files load exactly as a
converted checkpoint of that family would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

# mlx-lm class name in `architectures`, and the config keys each family adds to the base.
ARCHITECTURE_NAMES = {
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
TIED_BY_DEFAULT = frozenset({"qwen2", "gemma3_text"})  # as the small checkpoints ship
SLIDING_WINDOW = 16  # tokens: short enough that test prompts and generations exceed it
EXPERTS = 4
EXPERTS_PER_TOKEN = 2


def _mistral(spec: Any) -> dict[str, Any]:
    return {"rope_theta": 1000000.0, "rms_norm_eps": 1e-5}


def _qwen2(spec: Any) -> dict[str, Any]:
    return {"rope_theta": 1000000.0, "rms_norm_eps": 1e-6}


def _qwen3_moe(spec: Any) -> dict[str, Any]:
    # Layer 0 dense, the others sparse: both MLP kinds in two layers.
    return {
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "num_experts": EXPERTS,
        "num_experts_per_tok": EXPERTS_PER_TOKEN,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "moe_intermediate_size": spec.intermediate_size // 2,
        "norm_topk_prob": True,
    }


def _gemma3_text(spec: Any) -> dict[str, Any]:
    # Every second layer global, the others sliding-window: both kinds in two layers.
    return {
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": spec.head_size,
        "sliding_window": SLIDING_WINDOW,
        "sliding_window_pattern": 2,
    }


def _phi3(spec: Any) -> dict[str, Any]:
    return {"rope_theta": 10000.0, "rms_norm_eps": 1e-5}


def _gpt_oss(spec: Any) -> dict[str, Any]:
    return {
        "rope_theta": 150000,
        "rms_norm_eps": 1e-5,
        "num_local_experts": EXPERTS,
        "num_experts_per_tok": EXPERTS_PER_TOKEN,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": [
            "sliding_attention" if index % 2 == 0 else "full_attention"
            for index in range(spec.layers)
        ],
    }


def _deepseek_v3(spec: Any) -> dict[str, Any]:
    # Multi-head latent attention and a routed + shared expert MoE after one dense layer.
    rope_dim = spec.head_size // 2
    return {
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "q_lora_rank": spec.hidden_size // 2,
        "kv_lora_rank": spec.hidden_size // 2,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": spec.head_size - rope_dim,
        "v_head_dim": spec.head_size,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": 1,
        "num_experts_per_tok": EXPERTS_PER_TOKEN,
        "moe_intermediate_size": spec.intermediate_size // 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
    }


CONFIG_EXTRAS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3_moe": _qwen3_moe,
    "gemma3_text": _gemma3_text,
    "phi3": _phi3,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
}


def parameter_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every parameter mlx-lm's Model class for `config` has: dotted name -> shape."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    return {name: tuple(value.shape) for name, value in tree_flatten(model.parameters())}


def make_weights(
    config: dict[str, Any],
    tied: bool,
    silent_ids: tuple[int, ...],
    seed: int,
    gains: dict[str, float],
) -> dict[str, np.ndarray]:
    """Seeded float32 weights for every parameter, by what its name says it is.

    Linear and expert weights are fan-in scaled (gain LINEAR_GAIN), norms start at one, biases
    and attention sinks near zero; the output head gets the demo model's head treatment (no
    silent tokens, logits of std HEAD_GAIN) so greedy decoding gives printable, varied text.
    """
    rng = np.random.default_rng(seed)
    shapes = parameter_shapes(config)
    # gemma's RMSNorm scales by (1 + weight): store weight - 1 so every family gets the same.
    norm_offset = np.float32(1.0 if str(config["model_type"]).startswith("gemma") else 0.0)
    if tied:
        shapes.pop("lm_head.weight", None)  # gemma3 ties when the file has no lm_head
    hidden = int(config["hidden_size"])
    embedding_std = gains["tied_embedding_std"] if tied else gains["embedding_std"]
    if str(config["model_type"]).startswith("gemma"):
        # gemma multiplies the embeddings by sqrt(hidden): keep the residual stream's scale.
        embedding_std /= np.sqrt(hidden)
    weights: dict[str, np.ndarray] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("embed_tokens.weight"):
            weights[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(embedding_std)
        elif name == "lm_head.weight":
            weights[name] = _fan_in(rng, shape, gains["head_gain"])
        elif name == "model.norm.weight":
            # Random signs: with a tied head the current token's own embedding in the
            # residual would otherwise score highest and greedy decoding would repeat it.
            signs = np.where(rng.random(shape) < 0.5, -1.0, 1.0).astype(np.float32)
            if tied:
                signs *= np.float32(gains["head_gain"] / (embedding_std * np.sqrt(hidden)))
            weights[name] = signs - norm_offset
        elif len(shape) == 1 and "norm" in name:
            weights[name] = np.ones(shape, dtype=np.float32) - norm_offset
        elif leaf in ("bias", "sinks", "e_score_correction_bias"):
            weights[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        else:
            weights[name] = _fan_in(rng, shape, gains["linear_gain"])
    output = weights["model.embed_tokens.weight"] if tied else weights["lm_head.weight"]
    output[list(silent_ids)] = 0.0
    return weights


def _fan_in(rng: np.random.Generator, shape: tuple[int, ...], gain: float) -> np.ndarray:
    weight = rng.standard_normal(shape, dtype=np.float32)
    return weight * np.float32(gain / np.sqrt(shape[-1]))
