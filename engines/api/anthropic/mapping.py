"""A Messages request mapped in: its conversation, tools and output as a ChatInput, and its
sampling; whatever tandem cannot honour (images, documents, server tools, MCP) is a 400."""

from __future__ import annotations

import json
from collections.abc import Sequence

from engines.api.anthropic.schemas import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    OtherBlock,
    RedactedThinkingBlock,
    TextBlock,
    Thinking,
    ThinkingBlock,
    Tool,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from engines.api.conversation import (
    ChatInput,
    FieldNames,
    FunctionTool,
    OutputFormat,
    ToolCall,
    ToolMode,
    Turn,
)
from engines.api.errors import APIError
from engines.api.generation import Sampling
from engines.core.service import ServiceLimits

NAMES = FieldNames(
    messages="messages",
    tools="tools",
    tool_choice="tool_choice",
    output_format="output_config.format",
    schema="output_config.format.schema",
)
UNSUPPORTED = "unsupported_parameter"
# Why a block type is refused, for the ones clients send most; any other unknown type gets
# the generic reason.
BLOCK_REFUSALS = {
    "image": "images are not supported: this server's model reads text only",
    "document": "documents are not supported: this server's model reads text only",
    "search_result": "search results are not supported; pass their text as text blocks",
    "container_upload": "container uploads are not supported: this server runs no code",
}
# Separates the system prompt's text blocks (each is a paragraph of its own).
SYSTEM_SEPARATOR = "\n\n"
TOOL_ERROR_PREFIX = "Error: "  # an is_error tool result, as a chat template sees it


def chat_input_of(body: CountTokensRequest) -> ChatInput:
    """The conversation, tools and output format a Messages request asks for."""
    if body.mcp_servers:
        raise refused("mcp_servers", "MCP servers are not supported: tandem connects to none")
    tools = tuple(
        function_tool(tool, f"tools.{index}") for index, tool in enumerate(body.tools or ())
    )
    mode, forced, parallel = tool_choice_of(body.tool_choice, tools)
    output_format = body.output_config.format if body.output_config else None
    return ChatInput(
        turns=(*system_turns(body.system), *conversation_turns(body.messages)),
        tools=tools,
        tool_mode=mode,
        forced_tool=forced,
        parallel_tool_calls=parallel,
        output_format=None if output_format is None else OutputFormat(output_format.schema_),
        thinking=thinking_of(body.thinking),
        names=NAMES,
    )


def sampling_of(body: MessagesRequest, limits: ServiceLimits) -> Sampling:
    """max_tokens is required by Anthropic and large in agent CLIs (Claude Code asks for
    32000 or more): it is cut to --max-tokens-cap, then to the room the prompt leaves."""
    return Sampling(
        max_tokens=min(body.max_tokens, limits.max_tokens_cap),
        clamp_max_tokens=True,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=tuple(body.stop_sequences or ()),
        names={"stop": "stop_sequences", "prompt_tokens": "messages"},
    )


def thinking_of(thinking: Thinking | None) -> bool | None:
    """disabled: off; enabled: on; anything else (adaptive, ...): the template's default."""
    if thinking is None:
        return None
    return {"disabled": False, "enabled": True}.get(thinking.type)


def system_turns(system: str | Sequence[object] | None) -> list[Turn]:
    """The system prompt as one system turn (none when it is empty)."""
    if system is None or isinstance(system, str):
        text = system or ""
    else:
        text = SYSTEM_SEPARATOR.join(
            text_of_block(block, f"system.{index}") for index, block in enumerate(system)
        )
    return [Turn("system", text)] if text else []


def conversation_turns(messages: Sequence[Message]) -> list[Turn]:
    """The messages as chat turns: a user message's tool results become tool turns, an
    assistant's tool_use blocks its calls and its thinking blocks its reasoning."""
    called: set[str] = set()  # the ids of the tool_use blocks so far
    turns: list[Turn] = []
    for index, message in enumerate(messages):
        where = f"messages.{index}.content"
        if isinstance(message.content, str):
            turns.append(Turn(message.role, message.content))
        elif message.role == "assistant":
            turn = assistant_turn(message.content, where)
            called.update(call.id for call in turn.tool_calls)
            turns.append(turn)
        else:
            turns += user_turns(message.role, message.content, where, called)
    if messages[-1].role == "assistant":
        message = (
            "the last message is the assistant's: continuing a prefilled assistant turn is "
            "not supported; end with a user message"
        )
        raise APIError(400, message, param=f"messages.{len(messages) - 1}", code=UNSUPPORTED)
    return turns


def assistant_turn(blocks: Sequence[object], where: str) -> Turn:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for index, block in enumerate(blocks):
        param = f"{where}.{index}"
        if isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(ToolCall(block.id, block.name, arguments))
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, RedactedThinkingBlock):
            continue  # encrypted by Anthropic: nothing a local template can read
        else:
            texts.append(text_of_block(block, param, "in an assistant message"))
    return Turn("assistant", "".join(texts), tuple(calls), reasoning="".join(thoughts) or None)


def user_turns(role: str, blocks: Sequence[object], where: str, called: set[str]) -> list[Turn]:
    """Text blocks (runs of them joined) and tool results, in the order they came."""
    turns: list[Turn] = []
    texts: list[str] = []
    for index, block in enumerate(blocks):
        param = f"{where}.{index}"
        if isinstance(block, ToolResultBlock) and role == "user":
            if texts:
                turns.append(Turn(role, "".join(texts)))
                texts = []
            turns.append(tool_result_turn(block, param, called))
        else:
            texts.append(text_of_block(block, param, f"in a {role} message"))
    if texts or not turns:
        turns.append(Turn(role, "".join(texts)))
    return turns


def tool_result_turn(block: ToolResultBlock, param: str, called: set[str]) -> Turn:
    if block.tool_use_id not in called:
        message = (
            f"tool_result answers tool_use_id '{block.tool_use_id}', but no earlier "
            "assistant message has a tool_use block with that id"
        )
        raise APIError(400, message, param=f"{param}.tool_use_id", code="invalid_value")
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = "".join(
            text_of_block(part, f"{param}.content.{index}", "in a tool_result")
            for index, part in enumerate(content)
        )
    if block.is_error:
        text = TOOL_ERROR_PREFIX + text
    return Turn("tool", text, tool_call_id=block.tool_use_id)


def text_of_block(block: object, param: str, place: str = "in the system prompt") -> str:
    """A text block's text; any other block here is a 400 that names it."""
    if isinstance(block, TextBlock):
        return block.text
    if isinstance(block, OtherBlock):
        reason = BLOCK_REFUSALS.get(
            block.type,
            f"'{block.type}' blocks are not supported (this server takes text, tool_use, "
            "tool_result, thinking and redacted_thinking blocks)",
        )
        raise refused(param, reason)
    kind = getattr(block, "type", type(block).__name__)
    raise APIError(
        400, f"a '{kind}' block cannot appear {place}", param=param, code="invalid_value"
    )


def function_tool(tool: Tool, param: str) -> FunctionTool:
    if tool.type not in (None, "custom"):
        raise refused(
            f"{param}.type",
            f"'{tool.type}' ({tool.name}) is a tool Anthropic's servers define; tandem runs no "
            "server-side tools: offer a client tool with an input_schema instead",
        )
    if tool.input_schema is None:
        raise APIError(400, f"'{param}.input_schema' is required", param=f"{param}.input_schema")
    return FunctionTool(tool.name, tool.description, tool.input_schema)


def tool_choice_of(
    choice: ToolChoice | None, tools: Sequence[FunctionTool]
) -> tuple[ToolMode, str | None, bool]:
    """(tool mode, the tool a call is forced to, parallel calls allowed)."""
    if choice is None:
        return "auto", None, True
    parallel = not choice.disable_parallel_tool_use
    if choice.type in ("any", "tool") and not tools:
        message = f"tool_choice '{choice.type}' needs tools to call; none are offered"
        raise APIError(400, message, param="tool_choice", code="invalid_value")
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "'tool_choice.name' is required", param="tool_choice.name")
        return "required", choice.name, parallel
    mode: ToolMode = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return mode, None, parallel


def refused(param: str, reason: str) -> APIError:
    return APIError(400, reason, param=param, code=UNSUPPORTED)
