"""The OpenAI dialect's routes: chat completions and completions, in that order."""

from __future__ import annotations

from fastapi import APIRouter

from engines.api.openai import chat, completions
from engines.core.served_models import ServedModels


def create_router(models: ServedModels, max_prompt_tokens: int) -> APIRouter:
    router = APIRouter()
    router.include_router(chat.create_router(models, max_prompt_tokens))
    router.include_router(completions.create_router(models, max_prompt_tokens))
    return router
