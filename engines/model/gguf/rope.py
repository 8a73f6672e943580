"""Llama 3.1-style RoPE scaling, which llama.cpp writes as a tensor of per-frequency factors
(`rope_freqs`), back into the parameters mlx-lm's "llama3" rope takes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from engines.model.gguf.source import GGUFSource
from errors import ModelError

# What the converter's factors are checked against after fitting (float32 stored).
TOLERANCE = 1e-4
# Llama 3.1 to 3.3's own settings: used when too few factors lie between the two bands to fit.
LOW_FREQ_FACTOR = 1.0
HIGH_FREQ_FACTOR = 4.0
ORIGINAL_CONTEXT = 8192


def llama3_rope_scaling(
    source: GGUFSource, key: Callable[[str], str], config: dict[str, Any]
) -> dict[str, Any]:
    """mlx-lm's rope_scaling whose factors equal the GGUF's rope_freqs, or a ModelError.

    A factor is 1 for short wavelengths, `factor` for long ones and 1 / ((1 - s) / factor + s)
    between, with s linear in 1 / wavelength: s = original / (high - low) / wavelength - low /
    (high - low). Only the two ratios are determined, so low is taken as 1.
    """
    factors = np.asarray(source.tensors["rope_freqs.weight"].data, dtype=np.float64)
    dims = int(source.value(key("rope.dimension_count"), config["head_dim"]))
    wavelengths = 2 * np.pi * config["rope_theta"] ** (np.arange(0, dims, 2) / dims)
    factor = float(factors.max())
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": LOW_FREQ_FACTOR,
        "high_freq_factor": HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": ORIGINAL_CONTEXT,
    }
    between = (factors > 1 + TOLERANCE) & (factors < factor * (1 - TOLERANCE))
    if between.sum() >= 2 and factor > 1:
        smooth = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelengths[between], smooth, 1)
        if intercept < 0:
            scaling["high_freq_factor"] = _tidy(1 - 1 / intercept)
            scaling["original_max_position_embeddings"] = _tidy(-slope / intercept)
    expected = llama3_factors(scaling, wavelengths)
    if not np.allclose(expected, factors, rtol=TOLERANCE):
        raise ModelError(
            f"{source.paths[0]}: its rope_freqs factors fit no Llama 3 RoPE scaling "
            f"(got {np.round(factors, 4).tolist()})"
        )
    return scaling


def llama3_factors(scaling: dict[str, Any], wavelengths: np.ndarray) -> np.ndarray:
    """Each frequency's divisor under `scaling`, as mlx-lm's Llama3RoPE applies it."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    smooth = (original / wavelengths - low) / (high - low)
    factors = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelengths > original / low, factor, factors)
    return np.where(wavelengths < original / high, 1.0, factors)


def _tidy(value: float) -> float | int:
    """A fitted parameter as the config would spell it: 8192, not 8191.999999997."""
    nearest = round(value)
    return int(nearest) if abs(value - nearest) < 1e-6 * max(1.0, abs(value)) else float(value)
