"""A chat completion or completion request mapped in: its conversation, tools and output as a
ChatInput, its limits and sampling as a Sampling."""

from __future__ import annotations

from engines.api.conversation import ChatInput, FunctionTool, OutputFormat, ToolCall, Turn
from engines.api.generation import Sampling, check_max_tokens
from engines.api.openai.fields import chat_top_logprobs
from engines.api.openai.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from engines.core.service import Service


def chat_input_of(body: ChatCompletionRequest) -> ChatInput:
    """The conversation, tools and output format a chat completion asks for."""
    choice = body.tool_choice
    forced = None if isinstance(choice, str | None) else choice.function.name
    mode = "required" if forced is not None else (choice or "auto")
    output = None
    requested = body.response_format
    if requested is not None and requested.type == "json_object":
        output = OutputFormat()
    elif requested is not None and requested.type == "json_schema":
        schema = requested.json_schema.json_schema
        output = OutputFormat(None if schema is None else schema.model_dump())
    return ChatInput(
        turns=tuple(
            Turn(
                role=message.role,
                content=message.text(),
                tool_calls=tuple(
                    ToolCall(call.id, call.function.name, call.function.arguments)
                    for call in message.tool_calls or ()
                ),
                tool_call_id=message.tool_call_id,
                name=message.name,
                reasoning=message.reasoning_content,
            )
            for message in body.messages
        ),
        tools=tuple(
            FunctionTool(
                tool.function.name,
                tool.function.description,
                None if tool.function.parameters is None else tool.function.parameters.model_dump(),
            )
            for tool in body.tools or ()
        ),
        tool_mode=mode,
        forced_tool=forced,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        output_format=output,
        thinking=False if body.reasoning_effort == "none" else None,
        template_options=dict(body.chat_template_kwargs or {}),
    )


def max_tokens_of(body: SamplingFields, service: Service) -> tuple[str, int | None]:
    """(the field that sets it, max_tokens): max_completion_tokens wins over the legacy
    max_tokens (both are checked)."""
    for name in ("max_tokens", "max_completion_tokens"):
        check_max_tokens(getattr(body, name), name, service.limits)
    if body.max_completion_tokens is None:
        return "max_tokens", body.max_tokens
    return "max_completion_tokens", body.max_completion_tokens


def chat_sampling_of(body: ChatCompletionRequest, service: Service) -> Sampling:
    param, value = max_tokens_of(body, service)
    return Sampling(
        max_tokens=value,
        **body.sampling_values(),
        logprobs=chat_top_logprobs(body),
        names={
            "max_tokens": param,
            "prompt_tokens": "messages",
            "logprobs": "logprobs" if body.top_logprobs is None else "top_logprobs",
        },
    )


def completion_sampling_of(body: CompletionRequest, service: Service) -> Sampling:
    param, value = max_tokens_of(body, service)
    return Sampling(
        max_tokens=value,
        **body.sampling_values(),
        logprobs=body.logprobs,
        names={"max_tokens": param, "prompt_tokens": "prompt"},
    )
