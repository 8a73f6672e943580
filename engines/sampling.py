"""Sampling shared by every engine: the same request gives the same sampler and RNG state."""

from __future__ import annotations

import secrets
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from .base import GenerationRequest

Sampler = Callable[[mx.array], mx.array]


def request_seed(request: GenerationRequest) -> int:
    """The request's seed, or a fresh one; distributed engines share it with every rank."""
    return request.seed if request.seed is not None else secrets.randbits(31)


def make_request_sampler(temperature: float, top_p: float, seed: int) -> Sampler:
    """Seed mlx's RNG on this thread and return mlx-lm's sampler (temperature 0 = greedy)."""
    mx.random.seed(seed)
    # mlx-lm treats top_p == 0 or 1 as "off"; 1.0 is OpenAI's default.
    return make_sampler(temp=temperature, top_p=top_p if 0.0 < top_p < 1.0 else 0.0)
