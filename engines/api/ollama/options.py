"""Ollama's `options` in tandem's terms: the Sampling of a request, and the context it gets."""

from __future__ import annotations

import logging

from engines.api.errors import APIError
from engines.api.generation import Sampling
from engines.api.ollama.schemas import Options
from engines.core.service import ServiceLimits

log = logging.getLogger(__name__)

# Ollama's temperature when neither the request nor a Modelfile sets one.
DEFAULT_TEMPERATURE = 0.8
NO_LIMIT = -1  # num_predict: generate until the model stops (here: within the room left)
FILL_CONTEXT = -2  # num_predict: until the context is full (here: the same)
# Options Ollama knows that change nothing tandem can do: its runner's (GPU layers, threads,
# batch, memory mapping: tandem plans these itself) and samplers mlx-lm does not have. Taken
# and ignored, as Ollama ignores options a model's runner does not use.
IGNORED = frozenset(
    {
        "numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
        "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep",
        "tfs_z", "typical_p", "repeat_last_n", "mirostat", "mirostat_tau", "mirostat_eta",
        "penalize_newline",
    }
)  # fmt: skip
# Each option's name in GenerationRequest's terms -> the body's, for the 400 that names it.
NAMES = {
    "max_tokens": "options.num_predict",
    "temperature": "options.temperature",
    "top_p": "options.top_p",
    "top_k": "options.top_k",
    "min_p": "options.min_p",
    "stop": "options.stop",
    "seed": "options.seed",
    "repetition_penalty": "options.repeat_penalty",
    "presence_penalty": "options.presence_penalty",
    "frequency_penalty": "options.frequency_penalty",
}


def sampling_of(options: Options | None, limits: ServiceLimits, prompt_param: str) -> Sampling:
    """The request's Sampling; `prompt_param` names the prompt in a 400 about its length."""
    options = options or Options()
    warn_unknown(options)
    stop = options.stop
    return Sampling(
        max_tokens=max_tokens_of(options.num_predict, limits),
        clamp_max_tokens=True,  # Ollama stops at a full context rather than refuse
        temperature=options.temperature,
        default_temperature=DEFAULT_TEMPERATURE,
        top_p=options.top_p,
        top_k=options.top_k,
        min_p=options.min_p,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        seed=options.seed,
        repetition_penalty=options.repeat_penalty,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        names={**NAMES, "prompt_tokens": prompt_param},
    )


def max_tokens_of(num_predict: int | None, limits: ServiceLimits) -> int | None:
    """num_predict as max_tokens: absent keeps the server's default; -1 and -2 (no limit, fill
    the context) become the operator's cap, cut to the room the prompt leaves."""
    if num_predict is None:
        return None
    if num_predict in (NO_LIMIT, FILL_CONTEXT):
        return limits.max_tokens_cap
    if not 1 <= num_predict <= limits.max_tokens_cap:
        raise APIError(
            400,
            f"options.num_predict must be -1 (no limit), -2 (fill the context) or between 1 "
            f"and {limits.max_tokens_cap}, got {num_predict}",
            param="options.num_predict",
            code="invalid_value",
        )
    return num_predict


def context_of(options: Options | None, context_tokens: int) -> int:
    """The context a request gets: num_ctx when it asks for less than --context-tokens; more
    is cut to it, as Ollama cuts num_ctx to what the model was trained for."""
    asked = options.num_ctx if options is not None else None
    if asked is None:
        return context_tokens
    if asked < 1:
        raise APIError(
            400,
            f"options.num_ctx must be a positive number of tokens, got {asked}",
            param="options.num_ctx",
            code="invalid_value",
        )
    if asked > context_tokens:
        log.info("options.num_ctx=%d cut to --context-tokens=%d", asked, context_tokens)
    return min(asked, context_tokens)


def warn_unknown(options: Options) -> None:
    unknown = sorted(set(options.model_extra or ()) - IGNORED)
    if unknown:
        log.warning("ignoring options Ollama does not define: %s", ", ".join(unknown))
