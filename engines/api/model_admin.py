"""POST /v1/models and DELETE /v1/models/{id}: load a model beside those served, or unload one.

A load is answered at once (202, the model listed as "starting") once the model is found and
fits; its engine loads in the background and GET /v1/models shows it "ok", or "failed" with
the reason. A model that does not fit beside the others is refused (409) with the planner's
numbers, and nothing served is disturbed. Both routes are under /v1: with --api-key they
need it, as every other.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal, Protocol

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from engines.api.errors import APIError
from engines.api.openai.errors import SERVER_FAILURE, UNAUTHORIZED, documented
from engines.api.openai.schemas import ModelCard
from engines.core.service import Service
from engines.core.service_registry import ServiceRegistry
from errors import ConfigError, ModelError, PlanError


class ModelExists(ConfigError):
    """A load of a model (or an id) served already."""


class ModelLoader(Protocol):
    def load(
        self, reference: str, parallelism: str | None = None, model_id: str | None = None
    ) -> Service: ...

    def unload(self, model_id: str) -> bool: ...

    def placements(self) -> dict[str, Any]: ...


class LoadModelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="as --model names one: a directory, a GGUF "
                       "file, ollama:NAME[:TAG], a Hugging Face repo id, or 'demo'")  # fmt: skip
    parallelism: Literal["auto", "single", "tp", "pp"] | None = None  # default: serve's own
    id: str | None = Field(None, min_length=1, description="the name clients use")


class DeletedModel(BaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: bool = True


def card_of(service: Service, created: int) -> ModelCard:
    return ModelCard(
        id=service.model_id,
        created=created,
        revision=service.model_revision,
        state=service.state,
        state_reason=service.state_reason,
    )


def create_router(models: ServiceRegistry, loader: ModelLoader) -> APIRouter:
    router = APIRouter()

    @router.post(
        "/v1/models",
        status_code=202,
        responses={
            400: documented("an invalid request, or a model that cannot be found or read"),
            **UNAUTHORIZED,
            409: documented("the model is served already, or does not fit beside the others"),
            **SERVER_FAILURE,
        },
    )
    async def load_model(body: LoadModelRequest) -> JSONResponse:
        try:
            service = await asyncio.to_thread(loader.load, body.model, body.parallelism, body.id)
        except ModelExists as error:
            raise APIError(409, str(error), param="model", code="model_exists") from None
        except (ConfigError, ModelError) as error:
            raise APIError(400, str(error), param="model", code="invalid_value") from None
        except PlanError as error:
            raise APIError(409, str(error), param="model", code="model_does_not_fit") from None
        return JSONResponse(card_of(service, int(time.time())).model_dump(), status_code=202)

    @router.delete(
        "/v1/models/{model_id:path}",
        responses={**UNAUTHORIZED, 404: documented("no such model"), **SERVER_FAILURE},
    )
    async def unload_model(model_id: str) -> DeletedModel:
        service = models.find(model_id)
        if service is None or not await asyncio.to_thread(loader.unload, service.model_id):
            message = f"the model '{model_id}' is not served; served: {models.describe_ids()}"
            raise APIError(404, message, param="model_id", code="model_not_found")
        return DeletedModel(id=service.model_id)

    @router.get("/v1/placements", responses={**UNAUTHORIZED, **SERVER_FAILURE})
    async def placements() -> JSONResponse:
        """Where every model known would go if placed now: each candidate placement, each
        machine's memory before and after, predicted speeds when measured."""
        return JSONResponse(await asyncio.to_thread(loader.placements))

    return router
