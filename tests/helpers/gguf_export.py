"""Export a demo model as GGUF the way llama.cpp's convert_hf_to_gguf.py would: its tensor
names (from gguf-py's own TensorNameMap), the q/k row interleave of llama-family RoPE, Gemma's
norm + 1, fused phi3 projections as they are, and its block quantizations.

Returns the values the file holds, back in mlx-lm's names and order: the weights of the
reference model a round trip must reproduce (llama.cpp would compute with exactly these).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, quants

from tests.helpers.gguf_k_quants import quantize_q4_k, quantize_q6_k

T = GGMLQuantizationType
# mlx-lm model type -> GGUF architecture, as the converter registers the HF classes.
GGUF_ARCHITECTURES = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "mistral": gguf.MODEL_ARCH.LLAMA,  # MistralForCausalLM converts as llama
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
}
PERMUTED = frozenset({"llama", "mistral"})  # the converter's LlamaModel interleaves q/k rows
NORM_SHIFTED = frozenset({"gemma3_text"})  # Gemma3Model adds 1 to every *norm.weight
KEPT_FLOAT = ("norm", "mlp.gate.weight")  # 1-D tensors and MoE routers stay F32
# llama.cpp's Q4_K_M: Q4_K, with Q6_K where precision pays (a simplification of its rules).
Q4_K_M = {"embed_tokens": T.Q6_K, "lm_head": T.Q6_K, "v_proj": T.Q6_K, "down_proj": T.Q6_K}
# The type a tensor falls back to when its rows do not split into the chosen type's blocks.
FALLBACK = T.Q8_0
ENCODERS = {T.Q4_K: quantize_q4_k, T.Q6_K: quantize_q6_k}  # the K types gguf-py cannot write


def export_gguf(
    model_dir: Path,
    out_path: Path,
    quantization: GGMLQuantizationType,
    split_max_tensors: int = 0,
    architecture_name: str | None = None,
    pre_tokenizer: str = "gpt-2",
    mixture: dict[str, GGMLQuantizationType] | None = None,
    chat_template: bool = True,
) -> dict:
    """Write `model_dir` (a float demo model) as a GGUF; return the values it holds by mlx-lm
    parameter name (float32, mlx-lm's row order and norm convention).

    `split_max_tensors`: split as gguf-split does (OUT-00001-of-0000N.gguf beside `out_path`);
    `architecture_name`: the general.architecture written (a test of refusals names another);
    `pre_tokenizer`: tokenizer.ggml.pre (one tandem does not know fails the import last);
    `mixture`: other types for tensors whose mlx-lm name contains a key, as llama.cpp's
    Q4_K_M gives embeddings, v and down projections Q6_K;
    `chat_template`: False writes no tokenizer.chat_template (a base model's GGUF).
    """
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config["model_type"]
    architecture = GGUF_ARCHITECTURES[model_type]
    weights = {
        name: np.array(value.astype(mx.float32))
        for path in sorted(model_dir.glob("model*.safetensors"))
        for name, value in mx.load(str(path)).items()
    }
    names = gguf.get_tensor_name_map(architecture, config["num_hidden_layers"])
    # llama.cpp's qwen3moe routes every layer; the demo's dense layer 0 takes the dense names.
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(
        str(out_path),
        architecture_name or gguf.MODEL_ARCH_NAMES[architecture],
        split_max_tensors=split_max_tensors,
    )
    _write_hyperparameters(writer, config)
    _write_vocabulary(writer, model_dir, config, pre_tokenizer)
    if chat_template:
        tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
        writer.add_chat_template(tokenizer_config["chat_template"])
    held = {}
    for name in sorted(weights):
        values = weights[name]
        hf_name = name.replace(".mlp.switch_mlp.", ".mlp.experts.")  # stacked experts
        suffixes = (".weight", ".bias")
        gguf_name = names.get_name(hf_name, try_suffixes=suffixes) or dense_names.get_name(
            hf_name, try_suffixes=suffixes
        )
        if gguf_name is None:
            raise KeyError(f"gguf-py's map has no name for {hf_name}")
        stored = values
        if model_type in NORM_SHIFTED and name.endswith("norm.weight"):
            stored = stored + np.float32(1.0)
        if model_type in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            stored = interleave_rope_rows(stored, heads)
        chosen = next((kind for part, kind in (mixture or {}).items() if part in name), None)
        kind = _tensor_type(name, stored, chosen or quantization)
        raw = _encode(stored, kind)
        writer.add_tensor(gguf_name, raw, raw_shape=raw.shape, raw_dtype=kind)
        held[name] = _held_value(values, kind)
    if (config.get("rope_scaling") or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def interleave_rope_rows(values: np.ndarray, heads: int) -> np.ndarray:
    """What the converter does to q/k rows: each head's halves -> alternating pairs."""
    shape = values.shape
    head_dim = shape[0] // heads
    return values.reshape(heads, 2, head_dim // 2, *shape[1:]).swapaxes(1, 2).reshape(shape).copy()


def llama3_rope_factors(config: dict) -> np.ndarray:
    """The converter's rope_freqs: 1 for short wavelengths, the factor for long ones, a
    harmonic blend between."""
    scaling = config["rope_scaling"]
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    head_dim = config["head_dim"]
    frequencies = 1.0 / config["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    factors = []
    for frequency in frequencies:
        wavelength = 2 * np.pi / frequency
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _held_value(original: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """The quantized values in mlx-lm's order: quantizing whole rows commutes with reordering
    them, so quantizing the original order gives the same numbers."""
    if kind == T.F32:
        return original
    return quants.dequantize(_encode(original, kind), kind)


def _tensor_type(name: str, values: np.ndarray, chosen: GGMLQuantizationType):
    if values.ndim < 2 or any(part in name for part in KEPT_FLOAT):
        return T.F32
    block = gguf.GGML_QUANT_SIZES[chosen][0]
    if values.shape[-1] % block:
        return FALLBACK
    return chosen


def _encode(values: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    if kind == T.F32:
        return values.astype(np.float32)
    if kind in ENCODERS:
        return ENCODERS[kind](values)
    return quants.quantize(values.astype(np.float32), kind)


def _write_hyperparameters(writer: gguf.GGUFWriter, config: dict) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if config["model_type"] == "qwen3_moe":
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config["model_type"] == "gemma3_text":
        writer.add_sliding_window(config["sliding_window"])
        # llama.cpp assumes a period of 6 for Gemma 3; the demo's is 2, so the file says so.
        writer.add_sliding_window_pattern([i % 2 == 0 for i in range(config["num_hidden_layers"])])


def _write_vocabulary(
    writer: gguf.GGUFWriter, model_dir: Path, config: dict, pre_tokenizer: str
) -> None:
    """The demo's byte-level BPE as a gpt2-style GGUF vocabulary."""
    document = json.loads((model_dir / "tokenizer.json").read_text())
    vocabulary = dict(document["model"]["vocab"])
    special = {token["content"]: token["id"] for token in document["added_tokens"]}
    vocabulary.update(special)
    tokens = sorted(vocabulary, key=vocabulary.__getitem__)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL for token in tokens]
    )
    merges = document["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(False)
