"""The dialect's routes (a skeleton until the dialect is written)."""

from __future__ import annotations

from fastapi import APIRouter

from engines.core.service import Service


def create_router(service: Service, max_prompt_tokens: int) -> APIRouter:
    return APIRouter()
