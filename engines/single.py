"""SingleEngine: the whole model on this machine, generated with mlx-lm."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
from mlx_lm import load as load_model_and_tokenizer
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from planner.errors import EngineError

from .base import Engine, EngineInfo, GenerationRequest
from .sampling import make_request_sampler, request_seed

log = logging.getLogger(__name__)


class SingleEngine(Engine):
    """One process, one model: mlx-lm's own generate_step with a fresh KV cache per request."""

    def __init__(self, model_path: Path) -> None:
        self.model_path = Path(model_path)
        self.model = None
        self.tokenizer = None

    def load(self) -> None:
        try:
            self.model, self.tokenizer = load_model_and_tokenizer(str(self.model_path))
        except (OSError, ValueError) as error:
            raise EngineError(f"cannot load model {self.model_path}: {error}") from error
        log.info("single engine loaded %s", self.model_path)

    def generate_tokens(self, request: GenerationRequest) -> Iterator[int]:
        if self.model is None:
            raise EngineError("single engine used before load()")
        sampler = make_request_sampler(request.temperature, request.top_p, request_seed(request))
        prompt = mx.array(request.prompt_tokens, dtype=mx.uint32)
        cache = make_prompt_cache(self.model)
        for token, _ in generate_step(
            prompt, self.model, max_tokens=request.max_tokens, sampler=sampler, prompt_cache=cache
        ):
            yield int(token)

    def info(self) -> EngineInfo:
        detail = {"model_path": str(self.model_path)}
        return EngineInfo(strategy="single", world_size=1, detail=detail)

    def close(self) -> None:
        self.model = None
        mx.clear_cache()
