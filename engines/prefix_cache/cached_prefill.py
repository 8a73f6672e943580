"""The first token of a prefix-cache hit, from one forward pass over the uncached rest.

mlx-lm's BatchGenerator prefills a prompt but its last token, then runs that token alone to
start decoding: one more forward pass and two more batch steps before the first token. A
hit leaves only a short rest to compute, so it is cheaper to run the whole rest on the
cached prefix at once and sample the first token from its last position, as the generator
would have (same processors, same sampler draw); the generator then continues from that
token with the whole prompt already in its cache. Only for a hit arriving at an empty batch:
one joining a running batch is cheaper computed with the batch (engines/decoding/decode_batch.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx


def first_token_from_cache(
    model: Any,
    caches: list[Any],
    rest: Sequence[int],
    prompt: Sequence[int],
    sampler: Callable[[mx.array], mx.array],
    processors: Sequence[Callable[[mx.array, mx.array], mx.array]],
) -> tuple[int, mx.array]:
    """Extend `caches` (holding the prompt's cached prefix) by `rest`, the prompt's remaining
    tokens; returns the first answer token and its (V,) log-probabilities."""
    logits = model(mx.array([list(rest)]), cache=caches)[:, -1, :]
    context = mx.array(list(prompt))  # what the processors see: the whole prompt
    for processor in processors:
        logits = processor(context, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    token = sampler(logprobs)
    mx.eval(token, logprobs, [cache.state for cache in caches])
    return int(token.item()), logprobs[0]
