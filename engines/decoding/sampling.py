"""Sampling shared by every engine: a request's own seeded sampler, independent of its batch."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from engines.core.engine import StepOutput, TopLogprobs
from engines.core.request import GenerationRequest

Sampler = Callable[[mx.array], mx.array]
Processor = Callable[[mx.array, mx.array], mx.array]  # (tokens so far, logits) -> logits
SEED_BITS = 31
# the request fields a sampler reads: unseeded requests alike in these share one
SAMPLER_FIELDS = ("temperature", "top_p", "top_k", "min_p")
MASK64 = 2**64 - 1


def request_seed(request: GenerationRequest) -> int:
    """The request's seed, or a fresh one; distributed engines share it with every rank."""
    return request.seed if request.seed is not None else secrets.randbits(SEED_BITS)


def mix64(seed: int, counter: int) -> int:
    """splitmix64 of (seed, counter): well-spread 64-bit keys, equal on every machine."""
    value = (seed * 0x9E3779B97F4A7C15 + counter + 1) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def make_request_sampler(request: GenerationRequest, seed: int | None = None) -> Sampler:
    """The request's sampler: `greedy`, or a RequestSampler seeded with `seed` or else the
    request's own (a greedy request needs none)."""
    if request.temperature <= 0:
        return greedy
    seed = request.seed if seed is None else seed
    if seed is None:
        raise ValueError(f"request {request.request_id} samples without a seed")
    return RequestSampler(request, seed)


class RequestSampler:
    """A sampler with its own random stream: the n-th draw uses key (seed, n).

    mlx-lm's samplers draw from mlx's global RNG, so a sequence's tokens would depend on
    which other sequences share its batch; a per-request key keeps a seeded request
    reproducible inside any batch, and identical on every tensor-parallel rank. `draws` is
    the index of the next draw: speculative decoding draws each verified position with its
    own index and sets it back to the positions it kept, so its tokens are those of
    decoding one at a time.
    """

    def __init__(self, request: GenerationRequest, seed: int) -> None:
        self.seed = seed
        self.draws = 0
        self.scale = 1.0 / request.temperature
        self.top_p, self.top_k, self.min_p = request.top_p, request.top_k, request.min_p
        self.nucleus = 0.0 < self.top_p < 1.0  # OpenAI's default 1.0 means "off"

    def __call__(self, logprobs: mx.array) -> mx.array:  # (B, V) -> (B,)
        token = self.draw(logprobs, self.draws)
        self.draws += 1
        return token

    def draw(self, logprobs: mx.array, index: int) -> mx.array:
        """Sample (B, V) -> (B,) with draw `index`'s key, leaving `draws` as it is."""
        key = mx.random.key(mix64(self.seed, index))
        # mlx-lm's filters, in mlx-lm's own order (make_sampler's): top-p, min-p, top-k
        if self.nucleus:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p > 0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if 0 < self.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.random.categorical(logprobs * self.scale, key=key)


def draw_each(sampler: Sampler, logprobs: mx.array) -> mx.array:
    """A token per position; a RequestSampler draws position i with its draw draws + i."""
    if not isinstance(sampler, RequestSampler):
        return sampler(logprobs)  # greedy: one argmax over every position
    first = sampler.draws
    sampler.draws += logprobs.shape[0]
    return mx.concatenate(
        [sampler.draw(logprobs[i : i + 1], first + i) for i in range(logprobs.shape[0])]
    )


def give_back_draws(sampler: Sampler | None, count: int) -> None:
    """The last `count` draws (of positions speculation rejected) are drawn again next, so
    each kept position has the draw of plain decoding; greedy draws nothing."""
    if isinstance(sampler, RequestSampler):
        sampler.draws -= count


class UnseededSamplers:
    """One sampler per setting of SAMPLER_FIELDS for the requests that name no seed.

    A request without a seed needs no stream of its own: sharing one lets mlx-lm sample a
    batch whose rows all share it in one call instead of one call per row (its
    GenerationBatch checks for the same sampler object). Seeded requests keep their own
    stream, so their tokens stay the same in any batch; in a batch that mixes both, mlx-lm
    calls each row's sampler alone, and a shared one simply draws once per such row.
    """

    def __init__(self) -> None:
        self._samplers: dict[tuple[Any, ...], Sampler] = {}

    def for_request(self, request: GenerationRequest) -> Sampler:
        if request.seed is not None or request.temperature <= 0:
            return make_request_sampler(request)
        settings = tuple(getattr(request, name) for name in SAMPLER_FIELDS)
        sampler = self._samplers.get(settings)
        if sampler is None:
            sampler = make_request_sampler(request, secrets.randbits(SEED_BITS))
            self._samplers[settings] = sampler
        return sampler


def make_request_processors(
    request: GenerationRequest, grammar: Processor | None = None
) -> list[Processor]:
    """The request's logits processors, in the order every engine applies them: mlx-lm's for
    its penalties, then its compiled `grammar`, last, so that no penalty lifts its mask."""
    processors = make_logits_processors(
        repetition_penalty=request.repetition_penalty or None,
        presence_penalty=request.presence_penalty or None,
        frequency_penalty=request.frequency_penalty or None,
    )
    if grammar is not None:
        processors.append(grammar)
    return processors


def token_logprobs(logprobs: mx.array, token: int, top: int) -> tuple[float, TopLogprobs]:
    """The sampled token's logprob and the `top` most likely tokens, from one (V,) row."""
    chosen = logprobs[token].item()
    if top <= 0:
        return chosen, ()
    best = mx.argpartition(-logprobs, kth=top - 1)[:top]
    values = logprobs[best].tolist()
    pairs = sorted(zip(best.tolist(), values, strict=True), key=lambda pair: -pair[1])
    return chosen, tuple(pairs)


def sampled(uid: int, token: int, logprobs: mx.array, top: int | None) -> StepOutput:
    """The step output of a sampled token, with its logprob and the top `top` when asked."""
    if top is None:
        return StepOutput(uid, token)
    chosen, best = token_logprobs(logprobs, token, top)
    return StepOutput(uid, token, None, chosen, best)
