"""A Responses request mapped in: its input items become turns, its fields a ChatInput and a
Sampling; the fields tandem cannot honour are refused here, by name."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from pydantic import BaseModel

from engines.api.conversation import (
    ChatInput,
    FieldNames,
    FunctionTool,
    OutputFormat,
    ToolCall,
    Turn,
)
from engines.api.errors import APIError
from engines.api.generation import Sampling
from engines.api.responses.objects import unsealed
from engines.api.responses.schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionToolSpec,
    InputItem,
    JsonObjectFormat,
    JsonSchemaFormat,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    joined,
)
from engines.core.service import ServiceLimits

log = logging.getLogger(__name__)

NAMES = FieldNames(
    messages="input",
    tools="tools",
    tool_choice="tool_choice",
    output_format="text.format",
    schema="text.format.schema",
)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Declared fields tandem cannot honour, with why: refused whenever set.
REFUSED = {
    "background": "background responses are not supported; stream instead",
    "conversation": "conversations are not stored by this server; use previous_response_id",
    "prompt": "stored prompt templates are not supported; send instructions and input",
}


def invalid(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def check_fields(body: ResponsesRequest) -> None:
    """400 for the first field set that tandem cannot honour or that contradicts another."""
    for name, reason in REFUSED.items():
        value = getattr(body, name)
        if value is not None and value is not False:
            raise invalid(reason, name, "unsupported_parameter")
    if not body.input and not isinstance(body.input, str) and body.previous_response_id is None:
        raise invalid("'input' is required and not empty (or previous_response_id)", "input")
    choice = body.tool_choice
    functions = [tool.name for tool in function_tools(body)]
    if choice is not None and not isinstance(choice, str | FunctionChoice):
        message = (
            f"tool_choice of type '{choice.type}' is not supported: this server runs no hosted "
            "tools; choose auto, none, required or a function"
        )
        raise invalid(message, "tool_choice", "unsupported_parameter")
    if choice == "required" and not functions:
        raise invalid("tool_choice 'required' needs function tools", "tool_choice")
    if isinstance(choice, FunctionChoice) and choice.name not in functions:
        message = f"tool_choice names '{choice.name}', which is not in tools {functions}"
        raise invalid(message, "tool_choice")
    forced = choice == "required" or isinstance(choice, FunctionChoice)
    if forced and wants_json(body):
        message = "text.format and a forced tool_choice cannot both constrain the output"
        raise invalid(message, "text.format")


def wants_json(body: ResponsesRequest) -> bool:
    text_format = body.text.format if body.text is not None else None
    return isinstance(text_format, JsonObjectFormat | JsonSchemaFormat)


def function_tools(body: ResponsesRequest) -> list[FunctionToolSpec]:
    return [tool for tool in body.tools or () if isinstance(tool, FunctionToolSpec)]


def note_ignored(body: ResponsesRequest) -> None:
    """Log what the request carries that tandem does not act on (hosted tools, new fields)."""
    hosted = [tool.type for tool in body.tools or () if not isinstance(tool, FunctionToolSpec)]
    if hosted:
        log.info("not offering hosted tools %s (tandem runs none)", hosted)
    unknown = body.unknown_fields()
    if unknown:
        log.info("ignoring request fields tandem does not know: %s", unknown)


def conversation_of(body: ResponsesRequest, earlier: tuple[Turn, ...] = ()) -> tuple[Turn, ...]:
    """The conversation so far: `earlier` (a stored response's) and then the input items.

    Calls follow their assistant turn (one turn holds the text and its calls, as chat
    templates render it); a reasoning item goes to the next assistant turn.
    """
    turns = list(earlier)
    if isinstance(body.input, str):
        return (*turns, Turn("user", body.input))
    calls = {call.id: call.name for turn in turns for call in turn.tool_calls}
    thought: str | None = None
    for index, item in enumerate(body.input or ()):
        turns, thought = _add_item(turns, item, thought, calls, f"input.{index}")
    return tuple(turns)


def _add_item(
    turns: list[Turn], item: InputItem, thought: str | None, calls: dict[str, str], param: str
) -> tuple[list[Turn], str | None]:
    last = turns[-1] if turns else None
    open_assistant = last is not None and last.role == "assistant"
    if isinstance(item, ReasoningItem):
        text = item.text() or unsealed(item.encrypted_content)
        return turns, "\n".join(filter(None, (thought, text)))
    if isinstance(item, MessageItem) and item.role == "assistant":
        text = joined(item.content)
        if open_assistant and not last.tool_calls:  # one turn: text and calls alike
            turns[-1] = dataclasses.replace(last, content=last.content + text)
            return turns, thought
        return [*turns, Turn("assistant", text, reasoning=thought)], None
    if isinstance(item, MessageItem):
        return [*turns, Turn(item.role, joined(item.content))], None
    if isinstance(item, FunctionCallItem):
        call = ToolCall(item.call_id, item.name, item.arguments)
        calls[item.call_id] = item.name
        if open_assistant:
            turns[-1] = dataclasses.replace(last, tool_calls=(*last.tool_calls, call))
            return turns, thought
        return [*turns, Turn("assistant", tool_calls=(call,), reasoning=thought)], None
    if isinstance(item, FunctionCallOutputItem):
        if item.call_id not in calls:
            message = (
                f"function_call_output answers call_id '{item.call_id}', but no function_call "
                "with that call_id came before it"
            )
            raise invalid(message, f"{param}.call_id")
        turn = Turn(
            "tool", joined(item.output), tool_call_id=item.call_id, name=calls[item.call_id]
        )
        return [*turns, turn], thought
    raise invalid(f"unsupported input item {item!r}", param)  # the schema refuses them first


def chat_input_of(body: ResponsesRequest, conversation: tuple[Turn, ...]) -> ChatInput:
    """The ChatInput: the instructions as a system turn first (never carried over from a
    previous response, as OpenAI), then the conversation."""
    instructions = () if body.instructions is None else (Turn("system", body.instructions),)
    choice = body.tool_choice
    forced = choice.name if isinstance(choice, FunctionChoice) else None
    mode = "required" if forced is not None else (choice or "auto")
    text_format = body.text.format if body.text is not None else None
    output = None
    if isinstance(text_format, JsonObjectFormat):
        output = OutputFormat()
    elif isinstance(text_format, JsonSchemaFormat):
        output = OutputFormat(text_format.json_schema.model_dump())
    effort = body.reasoning.effort if body.reasoning is not None else None
    return ChatInput(
        turns=(*instructions, *conversation),
        tools=tuple(
            FunctionTool(
                tool.name,
                tool.description,
                None if tool.parameters is None else tool.parameters.model_dump(),
            )
            for tool in function_tools(body)
        ),
        tool_mode=mode,
        forced_tool=forced,
        parallel_tool_calls=body.parallel_tool_calls is not False and body.max_tool_calls != 1,
        output_format=output,
        thinking=False if effort == "none" else None,
        names=NAMES,
    )


def logprobs_of(body: ResponsesRequest) -> int | None:
    """None (off), or how many alternatives each token's logprob comes with."""
    if body.top_logprobs is None and LOGPROBS_INCLUDE not in (body.include or ()):
        return None
    return body.top_logprobs or 0


def sampling_of(body: ResponsesRequest, limits: ServiceLimits) -> Sampling:
    """Without max_output_tokens, as much as fits: the room the prompt leaves, up to
    --max-tokens-cap (OpenAI's default is the model's limit; Codex never sends the field,
    and the server's short default would cut an agent's turn off as incomplete)."""
    values: dict[str, Any] = {"temperature": body.temperature, "top_p": body.top_p}
    absent = body.max_output_tokens is None
    return Sampling(
        max_tokens=limits.max_tokens_cap if absent else body.max_output_tokens,
        clamp_max_tokens=absent,
        **{name: value for name, value in values.items() if value is not None},
        logprobs=logprobs_of(body),
        names={
            "max_tokens": "max_output_tokens",
            "prompt_tokens": "input",
            "logprobs": "top_logprobs",
        },
    )


def settings_of(body: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as the response object echoes them (tools as given, hosted
    ones included, so a caller sees what it sent)."""
    reasoning = body.reasoning
    choice = body.tool_choice
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "prompt_cache_key": body.prompt_cache_key,
        "reasoning": {
            "effort": reasoning.effort if reasoning else None,
            "summary": (reasoning.summary or reasoning.generate_summary) if reasoning else None,
        },
        "safety_identifier": body.safety_identifier,
        "service_tier": "default",
        "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": dumped(body.text) or {"format": {"type": "text"}},
        "tool_choice": choice if isinstance(choice, str) else dumped(choice) or "auto",
        "tools": [dumped(tool) for tool in body.tools or ()],
        "top_logprobs": body.top_logprobs or 0,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled",
        "user": body.user,
        "background": False,
    }


def dumped(value: BaseModel | None) -> dict[str, Any] | None:
    # One member at a time: pydantic warns when it serializes a tagged union as a whole.
    return None if value is None else value.model_dump(by_alias=True, exclude_none=True)
