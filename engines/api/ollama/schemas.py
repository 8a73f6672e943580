"""The Ollama request bodies: pydantic models of /api/chat, /api/generate and /api/show."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engines.api.common_schemas import FUNCTION_NAME, MAX_MESSAGES, MAX_TOOLS, Integer, OpenObject

# Ollama's own levels for models that think at several efforts (gpt-oss); tandem has one.
ThinkLevel = Literal["low", "medium", "high"]
# "json", or a JSON schema; "" is Ollama's spelling of "no format".
Format = Literal["", "json"] | OpenObject


class OllamaModel(BaseModel):
    """Strict types, as Ollama's Go decoder (no "1" for 1); fields tandem does not know are
    ignored, as Ollama ignores them: a client a release ahead must still be served."""

    model_config = ConfigDict(strict=True, extra="ignore")


class Options(OllamaModel):
    """The options tandem honours; every other Ollama option is accepted and ignored
    (see options.py for which and why)."""

    model_config = ConfigDict(strict=True, extra="allow")

    temperature: float | None = None
    top_p: float | None = None
    top_k: Integer | None = None
    min_p: float | None = None
    num_predict: Integer | None = None
    stop: list[str] | str | None = None
    seed: Integer | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: Integer | None = None


class CalledFunction(OllamaModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)  # an object, not JSON text
    index: Integer | None = None


class ToolCall(OllamaModel):
    """A call the assistant made earlier in the conversation, replayed."""

    id: str | None = None
    function: CalledFunction


class Message(OllamaModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None  # an assistant's earlier thinking, passed back
    images: list[str] | None = None  # refused when not empty: tandem serves text models
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # the tool a tool message answers
    tool_call_id: str | None = None


class FunctionDefinition(OllamaModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: OpenObject | None = None  # a JSON schema


class Tool(OllamaModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class GenerationFields(OllamaModel):
    """What /api/chat and /api/generate share."""

    model: str = Field(min_length=1)
    stream: bool | None = None  # absent: streamed, as Ollama does
    format: Format | None = None
    options: Options | None = None
    think: bool | ThinkLevel | None = None
    keep_alive: Annotated[float | int | str | None, Field(union_mode="left_to_right")] = None

    def streamed(self) -> bool:
        return self.stream is not False

    def json_format(self) -> OpenObject | Literal["json"] | None:
        """The JSON output asked for: "json", a schema, or None ("" is none too)."""
        return self.format or None


class ChatRequest(GenerationFields):
    messages: list[Message] = Field(default_factory=list, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)


class GenerateRequest(GenerationFields):
    prompt: str | None = None
    system: str | None = None
    suffix: str | None = None  # fill-in-the-middle: refused when not empty
    template: str | None = None  # a Go template: refused when not empty
    context: list[Integer] | None = None  # deprecated by Ollama: refused when not empty
    raw: bool | None = None
    images: list[str] | None = None


class ShowRequest(OllamaModel):
    model: str | None = None
    name: str | None = None  # Ollama's older spelling of `model`
    verbose: bool | None = None

    def requested(self) -> str:
        return self.model or self.name or ""
