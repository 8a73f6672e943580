"""The Responses request body: pydantic models of `POST /v1/responses` and its input items."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from engines.api.common_schemas import FUNCTION_NAME, MAX_MESSAGES, MAX_TOOLS, Integer, OpenObject
from engines.core.request import MAX_TEMPERATURE, MAX_TOP_LOGPROBS

# Union members are tagged by their class names, which errors.describe_validation leaves out of
# the `param` it reports ("input.0.role", never "input.0.MessageItem.role").

# Content parts that carry what a text-only model cannot read.
UNREADABLE_PARTS = ("input_image", "input_file", "input_audio")


def type_of(value: Any) -> str | None:
    """The `type` of a tagged union member: a JSON object's, or (serializing) a model's."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else None


class ItemModel(BaseModel):
    """Strict types; fields nobody knows yet are let through (agent CLIs add them over time,
    e.g. an assistant message's `phase`), as at the top level (see ResponsesRequest)."""

    model_config = ConfigDict(strict=True, extra="allow")


class TextContent(ItemModel):
    type: Literal["input_text", "output_text", "summary_text", "reasoning_text"]
    text: str


class RefusalContent(ItemModel):
    type: Literal["refusal"]
    refusal: str


class UnreadableContent(ItemModel):
    """An image, file or audio part: refused by name (this server serves a text-only model)."""

    type: str

    @field_validator("type")
    @classmethod
    def refuse(cls, value: str) -> str:
        raise ValueError(
            f"'{value}' content is not supported: the served model reads text only "
            "(send input_text)"
        )


def _part_tag(value: Any) -> str:
    kind = type_of(value)
    if kind == "refusal":
        return "RefusalContent"
    return "UnreadableContent" if kind in UNREADABLE_PARTS else "TextContent"


ContentPart = Annotated[
    Annotated[TextContent, Tag("TextContent")]
    | Annotated[RefusalContent, Tag("RefusalContent")]
    | Annotated[UnreadableContent, Tag("UnreadableContent")],
    Discriminator(_part_tag),
]


def joined(content: str | list[ContentPart]) -> str:
    """The text of a message's content (parts joined without a separator, as OpenAI)."""
    if isinstance(content, str):
        return content
    return "".join(
        part.text if isinstance(part, TextContent) else getattr(part, "refusal", "")
        for part in content
    )


class MessageItem(ItemModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(ItemModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str  # JSON text


class FunctionCallOutputItem(ItemModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]


class ReasoningItem(ItemModel):
    """The model's earlier thinking, passed back: its text becomes the assistant turn's
    reasoning."""

    type: Literal["reasoning"]
    summary: list[TextContent] = []
    content: list[TextContent] | None = None
    encrypted_content: str | None = None

    def text(self) -> str:
        """Its content's text, else its summary's (encrypted_content: see mapping)."""
        parts = self.content if self.content else self.summary
        return "\n".join(part.text for part in parts)


INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class UnknownItem(ItemModel):
    """Any other input item (item_reference, hosted tools' calls, ...): refused by name."""

    type: str

    @field_validator("type")
    @classmethod
    def refuse(cls, value: str) -> str:
        raise ValueError(
            f"input items of type '{value}' are not supported; this server takes "
            f"{', '.join(INPUT_ITEM_TYPES)} items"
        )


ITEM_TAGS = {
    "message": "MessageItem",
    "function_call": "FunctionCallItem",
    "function_call_output": "FunctionCallOutputItem",
    "reasoning": "ReasoningItem",
}


def _item_tag(value: Any) -> str:
    return ITEM_TAGS.get(type_of(value) or "message", "UnknownItem")


InputItem = Annotated[
    Annotated[MessageItem, Tag("MessageItem")]
    | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")]
    | Annotated[ReasoningItem, Tag("ReasoningItem")]
    | Annotated[UnknownItem, Tag("UnknownItem")],
    Discriminator(_item_tag),
]


class FunctionToolSpec(ItemModel):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: OpenObject | None = None  # a JSON schema
    strict: bool | None = None


class HostedToolSpec(ItemModel):
    """A tool the server would run (web_search, file_search, local_shell, mcp, custom, ...):
    tandem runs none of them, so they are not offered to the model (see mapping.py)."""

    type: str


def _tool_tag(value: Any) -> str:
    return "FunctionToolSpec" if type_of(value) == "function" else "HostedToolSpec"


ToolSpec = Annotated[
    Annotated[FunctionToolSpec, Tag("FunctionToolSpec")]
    | Annotated[HostedToolSpec, Tag("HostedToolSpec")],
    Discriminator(_tool_tag),
]


class FunctionChoice(ItemModel):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)


class HostedChoice(ItemModel):
    """A tool_choice that names anything but a function (a hosted tool, allowed_tools, ...)."""

    type: str


def _choice_tag(value: Any) -> str:
    if isinstance(value, str):
        return "Mode"
    return "FunctionChoice" if type_of(value) == "function" else "HostedChoice"


ToolChoice = Annotated[
    Annotated[Literal["auto", "none", "required"], Tag("Mode")]
    | Annotated[FunctionChoice, Tag("FunctionChoice")]
    | Annotated[HostedChoice, Tag("HostedChoice")],
    Discriminator(_choice_tag),
]


class PlainTextFormat(ItemModel):
    type: Literal["text"]


class JsonObjectFormat(ItemModel):
    type: Literal["json_object"]


class JsonSchemaFormat(ItemModel):
    type: Literal["json_schema"]
    name: str = Field(pattern=FUNCTION_NAME)
    json_schema: OpenObject = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


FORMAT_TAGS = {
    "text": "PlainTextFormat",
    "json_object": "JsonObjectFormat",
    "json_schema": "JsonSchemaFormat",
}


def _format_tag(value: Any) -> str | None:
    return FORMAT_TAGS.get(type_of(value) or "")


TextFormat = Annotated[
    Annotated[PlainTextFormat, Tag("PlainTextFormat")]
    | Annotated[JsonObjectFormat, Tag("JsonObjectFormat")]
    | Annotated[JsonSchemaFormat, Tag("JsonSchemaFormat")],
    Discriminator(
        _format_tag,
        custom_error_type="invalid_format",
        custom_error_message="the type must be one of 'text', 'json_object', 'json_schema'",
    ),
]


class TextConfig(ItemModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; nothing to tune


class ReasoningConfig(ItemModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the old name


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`. Unknown top-level fields are accepted and logged, not refused:
    Codex CLI adds fields as OpenAI does, and a 400 on the day it does would break it. Fields
    whose meaning tandem cannot honour are declared and refused (mapping.check_fields)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    input: str | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: Annotated[list[ToolSpec], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: Integer | None = Field(default=None, ge=1)
    max_output_tokens: Integer | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: Integer | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    store: bool | None = None  # None: true, as OpenAI's default
    stream: bool | None = None
    stream_options: OpenObject | None = None  # include_obfuscation: nothing to obfuscate
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache needs no key
    prompt_cache_retention: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    # Declared to be refused when set (mapping.check_fields): tandem cannot honour them.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})
