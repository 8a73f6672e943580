"""The OpenAI-compatible HTTP shapes: pydantic request and response models, nothing else."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

MAX_STOP_SEQUENCES = 4
MAX_SEED = 2**64 - 1  # mlx seeds are unsigned 64-bit

Role = Literal["system", "developer", "user", "assistant"]
FinishReason = Literal["stop", "length"]


class RequestModel(BaseModel):
    """Strict types (no "1" for 1, no true for 1) and unknown fields ignored, as OpenAI does."""

    model_config = ConfigDict(strict=True, extra="ignore")


# -- requests ----------------------------------------------------------------------------------


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Role
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts are joined without a separator, as OpenAI)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingFields(RequestModel):
    """The fields chat and completions share: model, limits, sampling, streaming."""

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def check_stop_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if (
            isinstance(value, list)
            and len(value) <= MAX_STOP_SEQUENCES
            and all(isinstance(item, str) for item in value)
        ):
            return value
        raise ValueError(f"stop must be a string or a list of at most {MAX_STOP_SEQUENCES} strings")

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]

    @field_validator("prompt", mode="before")
    @classmethod
    def check_prompt_shape(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            if all(isinstance(item, str) for item in value):
                if len(value) == 1:
                    return value
                raise ValueError(f"only one prompt per request is supported, got {len(value)}")
            if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
                return value
        raise ValueError("prompt must be a string, a list of one string, or a list of token ids")


# -- responses ---------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def counted(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def drop_absent(self, serialize: Any) -> dict[str, Any]:
        # OpenAI omits absent delta keys: the final chunk carries `"delta": {}`.
        return {key: value for key, value in serialize(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: None = None


class Completion(BaseModel):
    """Both the non-streaming body and each streamed chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    revision: str | None = None  # Hugging Face commit of the weights (tandem extension)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
