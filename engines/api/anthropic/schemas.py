"""The Messages API's HTTP shapes: pydantic request and response models, nothing else.

Unknown fields are accepted (and ignored) at every level: an agent CLI adds fields every
month, and refusing them would break it the day it did. Fields whose meaning tandem cannot
honour are refused by the mapping (mapping.py), which names them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from engines.api.common_schemas import MAX_MESSAGES, MAX_TOOLS, Integer
from engines.core.request import MAX_STOP_CHARS, MAX_STOP_SEQUENCES, MAX_TOP_K

# Anthropic's own bound on temperature (OpenAI's goes to 2).
MAX_TEMPERATURE = 1.0


class MessagesModel(BaseModel):
    """Strict types (no "1" for 1); unknown fields kept aside (`model_extra`) and ignored."""

    model_config = ConfigDict(strict=True, extra="allow")


# -- content blocks ---------------------------------------------------------------------------


class TextBlock(MessagesModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(MessagesModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class OtherBlock(MessagesModel):
    """A block of a type tandem does not take (image, document, server tool results, ...):
    parsed only so that the mapping can refuse it by name."""

    type: str


# Tags name the block models (errors.describe_validation leaves capitalized union tags out
# of the field path it reports: "messages.0.content.1.text", not "...1.Text.text").
BLOCK_TAGS = {
    "text": "TextBlock",
    "tool_use": "ToolUseBlock",
    "tool_result": "ToolResultBlock",
    "thinking": "ThinkingBlock",
    "redacted_thinking": "RedactedThinkingBlock",
}
NOT_A_BLOCK = "each content block must be an object with a 'type'"


def _block_tag(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type")
    return BLOCK_TAGS.get(kind, "OtherBlock") if isinstance(kind, str) else "OtherBlock"


def _result_part_tag(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    return "TextBlock" if value.get("type") == "text" else "OtherBlock"


def _blocks(*models: type[BaseModel], tag: Any) -> Any:
    """A block of one of `models`, chosen by its type (tagged by the model's name)."""
    members = tuple(Annotated[model, Tag(model.__name__)] for model in models)
    return Annotated[
        Union[members],  # noqa: UP007 (a union built at run time)
        Discriminator(tag, custom_error_type="block", custom_error_message=NOT_A_BLOCK),
    ]


ResultPart = _blocks(TextBlock, OtherBlock, tag=_result_part_tag)


class ToolResultBlock(MessagesModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ResultPart] | None = None
    is_error: bool = False


class ThinkingBlock(MessagesModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # Anthropic's proof the thought is its own; meaningless here


class RedactedThinkingBlock(MessagesModel):
    type: Literal["redacted_thinking"]
    data: str


Block = _blocks(
    TextBlock,
    ToolUseBlock,
    ToolResultBlock,
    ThinkingBlock,
    RedactedThinkingBlock,
    OtherBlock,
    tag=_block_tag,
)


class Message(MessagesModel):
    # "system" mid-conversation: Claude Code sends it (beta mid-conversation-system)
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


# -- tools, tool choice, thinking -------------------------------------------------------------


class Tool(MessagesModel):
    """A client tool (no type, or "custom"); any other type is a tool Anthropic's servers
    define (web_search_..., bash_..., ...), refused by the mapping."""

    name: str = Field(min_length=1, max_length=128)
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(MessagesModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(MessagesModel):
    # "enabled", "adaptive", "disabled", ...: a type tandem does not know keeps the template's
    # default, since all a type can ask of a local template is to think or not.
    type: str
    budget_tokens: Integer | None = None  # accepted; a template has no thinking budget


class OutputFormat(MessagesModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(MessagesModel):
    effort: str | None = None  # accepted and ignored: no local meaning
    format: OutputFormat | None = None


StopSequence = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


# -- requests ----------------------------------------------------------------------------------


class CountTokensRequest(MessagesModel):
    """What a prompt is made of: the fields count_tokens and create share."""

    model: str
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    mcp_servers: list[Any] | None = None  # refused unless empty: MCP runs on Anthropic's side


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[Integer, Field(ge=1)]
    stop_sequences: list[StopSequence] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Annotated[Integer, Field(ge=0, le=MAX_TOP_K)] | None = None
    stream: bool = False
    # Accepted and ignored: no local meaning (docs/api.md lists them).
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    context_management: dict[str, Any] | None = None
    container: Any = None


# -- responses ---------------------------------------------------------------------------------


class Usage(BaseModel):
    input_tokens: int  # the prompt tokens not read from the prefix cache, as Anthropic counts
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0

    @classmethod
    def counted(cls, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> Usage:
        return cls(
            input_tokens=prompt_tokens - cached_tokens,
            output_tokens=output_tokens,
            cache_read_input_tokens=cached_tokens,
        )


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic signs its thoughts; a local model's are not signed


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: Any  # the call's arguments: an object, or the raw text when it was not JSON


Content = TextContent | ThinkingContent | ToolUseContent


class MessageBody(BaseModel):
    """The non-streamed response: one assistant message."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Content]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class TokenCount(BaseModel):
    input_tokens: int


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorBody(BaseModel):
    type: Literal["error"] = "error"
    error: ErrorDetail
