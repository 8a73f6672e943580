"""The GGUF architectures tandem imports: mlx-lm's model type for each, llama.cpp's tensor
names mapped back to mlx-lm's, and what llama.cpp's converter changed that must be undone."""

from __future__ import annotations

import re
from dataclasses import dataclass

from errors import ModelError

# Names outside the layers: llama.cpp's -> mlx-lm's.
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# A layer's tensors: llama.cpp's blk.N.<name> -> mlx-lm's model.layers.N.<name>.
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
# Gemma 3 normalizes four times a layer: around attention and around the MLP.
GEMMA3_LAYER_NAMES = {
    **LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 keeps HF's fused projections: q, k, v in attn_qkv and gate, up in ffn_up.
PHI3_LAYER_NAMES = {**LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"}
# Tensors that are facts for config.json, not weights: RoPE factors (phi3's LongRoPE, Llama
# 3.1's frequency scaling).
CONFIG_TENSORS = frozenset(
    {"rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight"}
)
LAYER_PATTERN = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<name>[a-z_0-9]+)\.(?P<leaf>weight|bias)$")
GLOBAL_PATTERN = re.compile(r"^(?P<name>[a-z_0-9]+)\.(?P<leaf>weight|bias)$")


@dataclass(frozen=True, slots=True)
class Architecture:
    """One GGUF architecture: its mlx-lm model type and what the converter did to it."""

    gguf_name: str  # general.architecture
    model_type: str  # mlx-lm's models/<model_type>.py
    class_name: str  # config.json's architectures entry
    layer_names: dict[str, str]
    # llama.cpp rotates adjacent pairs for llama-family RoPE, so its converter interleaves the
    # halves of every q and k head (HF rotates halves); mlx-lm's llama rotates halves again.
    permuted_rope: bool = False
    # Added to every norm weight by the converter (Gemma's RMSNorm scales by 1 + weight,
    # llama.cpp's by weight); mlx-lm's gemma adds the 1 itself.
    norm_offset: float = 0.0

    def mlx_name(self, gguf_name: str) -> str:
        """mlx-lm's parameter name for a llama.cpp tensor name; a ModelError when unknown."""
        if match := LAYER_PATTERN.match(gguf_name):
            name = self.layer_names.get(match.group("name"))
            if name is not None:
                return f"model.layers.{match.group('layer')}.{name}.{match.group('leaf')}"
        elif match := GLOBAL_PATTERN.match(gguf_name):
            name = GLOBAL_NAMES.get(match.group("name"))
            if name is not None:
                return f"{name}.{match.group('leaf')}"
        raise ModelError(
            f"GGUF tensor {gguf_name} has no place in mlx-lm's {self.model_type} model "
            f"(architecture {self.gguf_name})"
        )

    def is_norm(self, gguf_name: str) -> bool:
        return gguf_name.endswith("norm.weight")

    def rope_heads(self, gguf_name: str, heads: int, kv_heads: int) -> int | None:
        """How many heads' rows to un-interleave in this tensor (None: leave its rows)."""
        if not self.permuted_rope:
            return None
        if match := LAYER_PATTERN.match(gguf_name):
            if match.group("name") == "attn_q":
                return heads
            if match.group("name") == "attn_k":
                return kv_heads
        return None


ARCHITECTURES = {
    architecture.gguf_name: architecture
    for architecture in (
        # Mistral's GGUFs are written as llama: the converter treats both alike.
        Architecture("llama", "llama", "LlamaForCausalLM", LAYER_NAMES, permuted_rope=True),
        Architecture("qwen2", "qwen2", "Qwen2ForCausalLM", LAYER_NAMES),
        Architecture("qwen3", "qwen3", "Qwen3ForCausalLM", LAYER_NAMES),
        Architecture("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", LAYER_NAMES),
        Architecture(
            "gemma3", "gemma3_text", "Gemma3ForCausalLM", GEMMA3_LAYER_NAMES, norm_offset=1.0
        ),
        Architecture("phi3", "phi3", "Phi3ForCausalLM", PHI3_LAYER_NAMES),
    )
}


def find_architecture(gguf_name: str) -> Architecture:
    """The architecture for general.architecture, or a ModelError listing what is supported."""
    architecture = ARCHITECTURES.get(gguf_name)
    if architecture is None:
        raise ModelError(
            f"GGUF architecture {gguf_name!r} is not supported; tandem imports "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    return architecture
