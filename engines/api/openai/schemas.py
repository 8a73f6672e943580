"""The OpenAI-compatible HTTP shapes: pydantic request and response models, nothing else."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
)

from engines.api.common_schemas import (
    FUNCTION_NAME,
    MAX_MESSAGES,
    MAX_TOOLS,
    Integer,
    OpenObject,
    integral,
)
from engines.core.request import (
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
)

MAX_COMPLETION_LOGPROBS = 5  # completions: OpenAI's bound, below the request's MAX_TOP_LOGPROBS

Role = Literal["system", "developer", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "tool_calls"]


class RequestModel(BaseModel):
    """Strict types (no "1" for 1, no true for 1); an unknown field is a 400 that names it,
    as OpenAI does ("Unrecognized request argument"), never silently ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")


# -- requests ----------------------------------------------------------------------------------


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(RequestModel):
    """A tool call the assistant made earlier in the conversation."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Role
    # Required but nullable: an assistant turn that only called tools has `"content": null`.
    content: str | list[TextPart] | None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # the assistant's calls, passed to the template
    tool_call_id: str | None = None  # the call a tool message answers
    refusal: str | None = None  # sent back by clients that replay an assistant's message
    reasoning_content: str | None = None  # an assistant's earlier thinking, replayed

    def text(self) -> str:
        """The content as one string (text parts are joined without a separator, as OpenAI)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: OpenObject | None = None  # a JSON schema
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class TextFormat(RequestModel):
    type: Literal["text"]


class JsonObjectFormat(RequestModel):
    type: Literal["json_object"]


class JsonSchemaSpec(RequestModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    json_schema: OpenObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


class StreamOptions(RequestModel):
    include_usage: bool = False


Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]


class SamplingFields(RequestModel):
    """The fields chat and completions share: model, limits, sampling, streaming.

    Fields declared here but not honoured (see fields.py) are refused with a 400 naming them
    whenever they ask for something other than the default.
    """

    model: str
    max_tokens: Integer | None = None
    max_completion_tokens: Integer | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # vLLM's and mlx_lm.server's extensions; 0 turns each off
    top_k: Annotated[int, Field(ge=0, le=MAX_TOP_K), BeforeValidator(integral)] | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stop: (
        Annotated[str, Field(max_length=MAX_STOP_CHARS)]
        | Annotated[
            list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]],
            Field(max_length=MAX_STOP_SEQUENCES),
        ]
        | None
    ) = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED), BeforeValidator(integral)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1), BeforeValidator(integral)] | None = (
        None  # one choice per request
    )
    user: str | None = None  # an end-user id: logged with the request, never used otherwise
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(  # mlx-lm's extension
        default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    logit_bias: dict[str, float] | None = Field(default=None, max_length=0)  # unsupported

    @field_validator("stop", mode="before")
    @classmethod
    def check_stop_shape(cls, value: Any) -> Any:
        sequences = [value] if isinstance(value, str) else value
        if value is None or (
            isinstance(sequences, list)
            and len(sequences) <= MAX_STOP_SEQUENCES
            and all(isinstance(item, str) and len(item) <= MAX_STOP_CHARS for item in sequences)
        ):
            return value
        raise ValueError(
            f"stop must be a string or a list of at most {MAX_STOP_SEQUENCES} strings, each of "
            f"at most {MAX_STOP_CHARS} characters"
        )

    @field_validator("stream", "echo", "store", mode="before", check_fields=False)
    @classmethod
    def check_boolean(cls, value: Any) -> Any:
        # A Literal[False] also matches 0 (0 == False): only a JSON boolean is one.
        if value is not None and not isinstance(value, bool):
            raise ValueError("Input should be a valid boolean")
        return value

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_values(self) -> dict[str, Any]:
        """The sampling fields set, under GenerationRequest's names (generation.Sampling)."""
        values = {
            name: getattr(self, name)
            for name in (
                "temperature", "top_p", "top_k", "min_p", "seed",
                "repetition_penalty", "presence_penalty", "frequency_penalty",
            )
        }  # fmt: skip
        return {"stop": self.stop_sequences()} | {
            name: value for name, value in values.items() if value is not None
        }

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: bool | None = None
    top_logprobs: (
        Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), BeforeValidator(integral)] | None
    ) = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # identifiers and hints that change nothing in the output
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # refused unless absent or the default (fields.py says why)
    store: Literal[False] | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=0)
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None
    audio: None = None
    prediction: None = None
    # "none" turns a thinking template's thinking off; the others leave it on
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: passed to the chat template
    verbosity: None = None
    web_search_options: None = None
    functions: list[OpenObject] | None = Field(default=None, max_length=0)
    function_call: None = None


class CompletionRequest(SamplingFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
        | Annotated[
            list[Annotated[int, Field(ge=0), BeforeValidator(integral)]], Field(min_length=1)
        ]
    )
    logprobs: (
        Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS), BeforeValidator(integral)] | None
    ) = None
    # refused unless absent or the default (fields.py says why)
    echo: Literal[False] | None = None
    best_of: Annotated[int, Field(ge=1, le=1), BeforeValidator(integral)] | None = None
    suffix: Literal[""] | None = None

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
            value = [integral(item) for item in value]
            if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
                return value
        raise ValueError("prompt must be a string, a list of one string, or a list of token ids")


# -- responses ---------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class CompletionTokensDetails(BaseModel):
    """OpenAI's counts of predicted tokens: here the drafts of speculative decoding that the
    model accepted (each saved a decoding pass) and rejected."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    completion_tokens_details: CompletionTokensDetails = CompletionTokensDetails()

    @classmethod
    def counted(
        cls,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
        drafted_tokens: int = 0,
        accepted_tokens: int = 0,
    ) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
            completion_tokens_details=CompletionTokensDetails(
                accepted_prediction_tokens=accepted_tokens,
                rejected_prediction_tokens=drafted_tokens - accepted_tokens,
            ),
        )

    @classmethod
    def of(cls, final: Any) -> Usage:
        """The usage a final event (or a non-streaming Outcome) carries."""
        return cls.counted(
            final.prompt_tokens, final.completion_tokens, final.cached_tokens,
            final.drafted_tokens, final.accepted_tokens,
        )  # fmt: skip


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CalledFunction(BaseModel):
    name: str
    arguments: str


class AssistantToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # the thought of a thinking model, apart from the content (vLLM's and DeepSeek's field)
    reasoning_content: str | None = None
    tool_calls: list[AssistantToolCall] | None = None

    @model_serializer(mode="wrap")
    def drop_absent(self, serialize: Any) -> dict[str, Any]:
        body = serialize(self)
        for key in ("tool_calls", "reasoning_content"):
            if body.get(key) is None:
                body.pop(key, None)
        return body


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def drop_absent(self, serialize: Any) -> dict[str, Any]:
        # OpenAI omits absent delta keys: the final chunk carries `"delta": {}`.
        return {key: value for key, value in serialize(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


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
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """Both the non-streaming body and each streamed chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the API returns, whatever its status (OpenAI's shape)."""

    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    revision: str | None = None  # Hugging Face commit of the weights (tandem extension)
    # tandem extensions: "ok" (answering), "starting" (loading), "degraded" (re-planning),
    # "unloading" or "failed", and why when it is not "ok"
    state: str = "ok"
    state_reason: str = ""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
