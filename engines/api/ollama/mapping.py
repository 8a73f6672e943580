"""Ollama's chat and generate bodies as tandem's ChatInput: turns, tools, format, thinking."""

from __future__ import annotations

import json
import uuid

from engines.api.conversation import (
    ChatInput,
    FieldNames,
    FunctionTool,
    OutputFormat,
    ToolCall,
    Turn,
)
from engines.api.errors import APIError
from engines.api.ollama.schemas import ChatRequest, GenerateRequest, GenerationFields, Message

CHAT_NAMES = FieldNames(
    messages="messages",
    tools="tools",
    tool_choice="tools",  # Ollama has no tool choice: the model always chooses
    output_format="format",
    schema="format",
)
IMAGES = "tandem serves text models and takes no images"
TEMPLATE = "a Go prompt template is not supported: tandem renders the model's own chat template"
GENERATE_NAMES = FieldNames(
    messages="prompt", tools="tools", tool_choice="tools", output_format="format", schema="format"
)


def chat_input_of(body: ChatRequest) -> ChatInput:
    for index, message in enumerate(body.messages):
        if message.images:
            raise refused(f"messages.{index}.images", IMAGES)
    return ChatInput(
        turns=tuple(turn_of(message) for message in body.messages),
        tools=tuple(
            FunctionTool(
                tool.function.name,
                tool.function.description,
                None if tool.function.parameters is None else tool.function.parameters.model_dump(),
            )
            for tool in body.tools or ()
        ),
        output_format=output_format_of(body),
        thinking=thinking_of(body),
        names=CHAT_NAMES,
    )


def generate_input_of(body: GenerateRequest) -> ChatInput:
    """The prompt as one user turn (after `system`); with `raw` the turns are only what
    ReplyStream reads (thinking), the prompt goes to the model as it is."""
    if body.images:
        raise refused("images", IMAGES)
    if body.suffix:
        raise refused("suffix", "fill-in-the-middle is not supported by tandem")
    if body.template:
        raise refused("template", TEMPLATE)
    if body.context:
        raise APIError(
            400,
            "context (deprecated by Ollama) is not kept by tandem: send the conversation to "
            "/api/chat, or the whole text as the prompt",
            param="context",
            code="unsupported_parameter",
        )
    turns: tuple[Turn, ...] = ()
    if not body.raw:
        system = (Turn("system", body.system),) if body.system else ()
        turns = (*system, Turn("user", body.prompt or ""))
    return ChatInput(
        turns=turns,
        output_format=output_format_of(body),
        thinking=thinking_of(body),
        names=GENERATE_NAMES,
    )


def turn_of(message: Message) -> Turn:
    return Turn(
        role=message.role,
        content=message.content or "",
        tool_calls=tuple(
            ToolCall(
                call.id or f"call_{uuid.uuid4().hex[:24]}",
                call.function.name,
                json.dumps(call.function.arguments, ensure_ascii=False),
            )
            for call in message.tool_calls or ()
        ),
        tool_call_id=message.tool_call_id,
        name=message.tool_name,
        reasoning=message.thinking,
    )


def output_format_of(body: GenerationFields) -> OutputFormat | None:
    requested = body.json_format()
    if requested is None:
        return None
    return OutputFormat() if requested == "json" else OutputFormat(requested.model_dump())


def thinking_of(body: GenerationFields) -> bool | None:
    """think false turns the template's thinking off; true or a level asks for it (the
    route refuses that for a model that does not think); absent keeps the template's way."""
    if body.think is None:
        return None
    return body.think is not False


def refused(param: str, reason: str) -> APIError:
    return APIError(400, f"{param}: {reason}", param=param, code="unsupported_parameter")
