"""The Responses output shapes: the response object, its output items and its usage."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel

from engines.api.conversation import ToolCall
from engines.api.errors import APIError

Status = Literal["in_progress", "completed", "incomplete", "failed"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


# The thought in a reasoning item's `encrypted_content`, for clients that pass back only that
# (Codex CLI drops reasoning_text): plain text behind a marker, as nothing is secret from the
# caller; the marker keeps another server's sealed blob from being read as a thought.
SEALED_PREFIX = "tandem-thought-v1:"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sealed(thought: str) -> str:
    return SEALED_PREFIX + thought


def unsealed(value: str | None) -> str:
    """The thought a reasoning item's encrypted_content holds ("" for anyone else's)."""
    return value.removeprefix(SEALED_PREFIX) if value and value.startswith(SEALED_PREFIX) else ""


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[dict[str, Any]] = []


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(BaseModel):
    """The model's thought, whole, in `content`; tandem writes no summary of it."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = []
    content: list[ReasoningText] = []
    encrypted_content: str | None = None  # sealed(thought), when the request included it
    status: ItemStatus = "completed"


class MessageOutput(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "completed"
    content: list[OutputText] = []


class FunctionCallOutput(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus = "completed"

    @classmethod
    def of(cls, call: ToolCall) -> FunctionCallOutput:
        """The call's item; "incomplete" when max_tokens cut it short."""
        status: ItemStatus = "completed" if call.complete else "incomplete"
        return cls(
            id=new_id("fc"),
            call_id=call.id,
            name=call.name,
            arguments=call.arguments,
            status=status,
        )


OutputItem = ReasoningOutput | MessageOutput | FunctionCallOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache already held
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def counted(cls, input: int, output: int, cached: int, reasoning: int) -> ResponseUsage:
        return cls(
            input_tokens=input,
            input_tokens_details=InputTokensDetails(cached_tokens=cached),
            output_tokens=output,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=min(reasoning, output)),
            total_tokens=input + output,
        )


class ResponseError(BaseModel):
    code: str
    message: str


class Response(BaseModel):
    """The response object: what was generated, and the request's settings echoed back."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Status
    error: ResponseError | None = None
    incomplete_details: dict[str, str] | None = None
    model: str
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    # The request's settings, as the SDK's Response model expects them back.
    settings: dict[str, Any] = {}

    def finished(
        self,
        output: list[OutputItem],
        usage: ResponseUsage,
        finish_reason: str,
    ) -> Response:
        """This response ended naturally: completed, or incomplete when it ran out of tokens."""
        incomplete = finish_reason == "length"
        return self.model_copy(
            update={
                "status": "incomplete" if incomplete else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "completed_at": None if incomplete else int(time.time()),
                "output": output,
                "usage": usage,
            }
        )

    def failed(self, error: APIError, output: list[OutputItem]) -> Response:
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"
        return self.model_copy(
            update={
                "status": "failed",
                "error": ResponseError(code=code, message=error.message),
                "output": output,
            }
        )

    def body(self) -> dict[str, Any]:
        """The wire form: settings flattened beside the generated fields."""
        fields = self.model_dump(exclude={"settings"})
        return {**self.settings, **fields}
