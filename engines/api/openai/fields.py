"""Which OpenAI request fields this server honours: every declared field it cannot honour is
refused with a 400 that names it, never silently ignored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.api.errors import APIError
from engines.api.openai.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

UNSUPPORTED = "unsupported_parameter"


@dataclass(frozen=True, slots=True)
class Refusal:
    """A declared field this server does not honour, the values that ask for nothing, and why."""

    field: str
    harmless: tuple[Any, ...]  # values that change nothing (None is always one)
    reason: str


SHARED_REFUSALS = (Refusal("logit_bias", ({},), "logit_bias is not supported by this server"),)
CHAT_REFUSALS = (
    Refusal("store", (False,), "this server stores no completions (store must be false)"),
    Refusal(
        "metadata", ({},), "metadata only applies to stored completions; this server stores none"
    ),
    Refusal("service_tier", ("auto", "default"), "this server has one service tier: 'auto'"),
    Refusal("modalities", ([], ["text"], ["text", "text"]), "this server answers with text only"),
    Refusal("audio", (), "audio output is not supported"),
    Refusal("prediction", (), "predicted outputs are not supported"),
    Refusal("verbosity", (), "verbosity is not supported by this server"),
    Refusal("web_search_options", (), "web search is not supported"),
    Refusal("functions", ([],), "the deprecated 'functions' field is not supported; use 'tools'"),
    Refusal(
        "function_call",
        (),
        "the deprecated 'function_call' field is not supported; use 'tool_choice'",
    ),
)
COMPLETION_REFUSALS = (
    Refusal("echo", (False,), "echo is not supported by this server"),
    Refusal("best_of", (1,), "only best_of=1 is supported"),
    Refusal("suffix", ("",), "suffix (insertion) is not supported by this server"),
)


def refusal_of(param: str | None) -> str | None:
    """Why a top-level field is not honoured, or None for any other field."""
    for refusal in SHARED_REFUSALS + CHAT_REFUSALS + COMPLETION_REFUSALS:
        if refusal.field == param:
            return refusal.reason
    return None


def check_chat_fields(body: ChatCompletionRequest) -> None:
    """400 for the first field a chat request sets that this server cannot honour, or sets
    in a way that contradicts another."""
    _check_refusals(body, SHARED_REFUSALS + CHAT_REFUSALS)
    if body.top_logprobs is not None and body.logprobs is False:
        message = "top_logprobs needs logprobs set to true"
        raise APIError(400, message, param="top_logprobs", code="invalid_value")
    if body.tool_choice is not None and body.tools is None and body.tool_choice != "none":
        message = "tool_choice needs tools"
        raise APIError(400, message, param="tool_choice", code="invalid_value")
    wants_json = body.response_format is not None and body.response_format.type != "text"
    forced = body.tool_choice == "required" or not isinstance(body.tool_choice, str | None)
    if forced and body.tools and wants_json:
        message = "response_format and a forced tool_choice cannot both constrain the output"
        raise APIError(400, message, param="response_format", code="invalid_value")


def check_completion_fields(body: CompletionRequest) -> None:
    """400 for the first field a completion request sets that this server cannot honour."""
    _check_refusals(body, SHARED_REFUSALS + COMPLETION_REFUSALS)


def chat_top_logprobs(body: ChatCompletionRequest) -> int | None:
    """GenerationRequest.logprobs for chat: None (off) or how many alternatives per token.

    top_logprobs alone asks for them too (logprobs=false with it is refused above).
    """
    if body.logprobs or (body.logprobs is None and body.top_logprobs is not None):
        return body.top_logprobs or 0
    return None


def _check_refusals(body: SamplingFields, refusals: tuple[Refusal, ...]) -> None:
    for refusal in refusals:
        value = getattr(body, refusal.field)
        if value is not None and not _is_harmless(value, refusal.harmless):
            raise APIError(400, refusal.reason, param=refusal.field, code=UNSUPPORTED)


def _is_harmless(value: Any, harmless: tuple[Any, ...]) -> bool:
    plain = value.model_dump() if hasattr(value, "model_dump") else value
    return any(plain == candidate for candidate in harmless)
