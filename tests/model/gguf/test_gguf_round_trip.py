"""Every architecture through GGUF and back: a tiny demo model exported as llama.cpp's converter
would (its names, q/k interleave, Gemma's norm + 1), imported by tandem, decodes the same greedy
tokens as a reference model holding the GGUF's own values (what llama.cpp computes with).

Native (Q8_0, Q4_0, MXFP4), exactly moved (Q4_K, Q5_1) and float (F16) types must give the same
tokens and logits equal to float rounding (F16: to float16's, the type it computes in); a
re-quantized type (Q6_K -> mlx 8-bit, in a Q4_K_M-like mixture) must stay
within the error it is measured to leave (docs/gguf.md): logits within 10% (rms, relative) and
the same next token at >= 85% of positions fed the same text (random demo weights have
near-ties, so its free-running tokens may part ways).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from tests.helpers.gguf_export import Q4_K_M
from tests.helpers.gguf_round_trip import imported_config, round_trip

T = GGMLQuantizationType
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "phi3")
TINY = {"layers": 2, "heads": 4, "kv_heads": 2, "hidden": 64}
K_SIZED = {**TINY, "hidden": 256}  # K types quantize rows in blocks of 256
EXACT_LOGIT_ERROR = 1e-4
REQUANTIZED_LOGIT_ERROR = 0.10
REQUANTIZED_AGREEMENT = 0.85
HALF_LOGIT_ERROR = 1e-2  # an F16 file imports as float16 and computes in it
CASES = [
    *((arch, T.Q8_0, TINY) for arch in ARCHITECTURES),
    *((arch, T.Q4_0, TINY) for arch in ("qwen3_moe", "phi3")),
    ("llama", T.Q4_K, K_SIZED),
    ("gemma3_text", T.Q4_K, K_SIZED),
    ("phi3", T.Q5_1, TINY),
    ("qwen3", T.MXFP4, TINY),
    ("qwen2", T.F16, TINY),
]


@pytest.mark.parametrize(
    ("arch", "quantization", "spec"),
    CASES,
    ids=[f"{arch}-{quantization.name}" for arch, quantization, _ in CASES],
)
def test_round_trip_decodes_the_same_tokens(
    gguf_root: Path, arch: str, quantization: GGMLQuantizationType, spec: dict
) -> None:
    result = round_trip(gguf_root, arch, quantization, **spec)
    assert result.imported_tokens == result.reference_tokens
    assert result.agreement == 1.0
    assert result.logit_error < (HALF_LOGIT_ERROR if quantization == T.F16 else EXACT_LOGIT_ERROR)
    config = imported_config(result.imported)
    assert config["model_type"] == ("llama" if arch == "mistral" else arch)
    assert config["num_key_value_heads"] == spec["kv_heads"]


def test_requantized_type_stays_within_its_measured_error(gguf_root: Path) -> None:
    """A Q4_K_M-like file: Q4_K (exact) with Q6_K embeddings, v and down projections (to 8 bits)."""
    result = round_trip(gguf_root, "llama", T.Q4_K, mixture=Q4_K_M, **K_SIZED)
    assert result.logit_error < REQUANTIZED_LOGIT_ERROR
    assert result.agreement >= REQUANTIZED_AGREEMENT
    quantization = imported_config(result.imported)["quantization"]
    assert (quantization["bits"], quantization["group_size"]) == (4, 32)
    for layer in ("model.embed_tokens", "lm_head", "model.layers.1.self_attn.v_proj"):
        assert quantization[layer]["bits"] == 8
    assert "model.layers.1.self_attn.q_proj" not in quantization  # the default: Q4_K's 4 bits


def test_round_trip_needs_the_rope_rows_undone(gguf_root: Path) -> None:
    """The check can fail: llama read without un-interleaving q/k rows decodes other tokens."""
    import dataclasses

    from engines.model.gguf import architectures

    llama = architectures.ARCHITECTURES["llama"]
    architectures.ARCHITECTURES["llama"] = dataclasses.replace(llama, permuted_rope=False)
    try:
        result = round_trip(gguf_root, "llama", T.Q8_0, **TINY)
    finally:
        architectures.ARCHITECTURES["llama"] = llama
    assert result.imported_tokens != result.reference_tokens
    assert result.logit_error > REQUANTIZED_LOGIT_ERROR


def test_llama3_rope_factors_become_mlx_lm_rope_scaling(gguf_root: Path) -> None:
    """Llama 3.1's RoPE scaling, which the converter writes as a rope_freqs tensor."""
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 2048,  # two of the demo's 8 frequencies blend
    }
    result = round_trip(gguf_root, "llama", T.Q8_0, config={"rope_scaling": scaling}, **TINY)
    assert result.imported_tokens == result.reference_tokens
    assert result.logit_error < EXACT_LOGIT_ERROR
    assert imported_config(result.imported)["rope_scaling"] == scaling
