"""A finished reply as Responses output: its items (reasoning, message, function calls) and
its usage — the same for a streamed response and a whole one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.api.conversation import ToolCall
from engines.api.openai.logprobs import chat_logprobs
from engines.api.reply import Reply
from engines.api.responses.objects import (
    FunctionCallOutput,
    MessageOutput,
    OutputItem,
    OutputText,
    ReasoningOutput,
    ReasoningText,
    ResponseUsage,
    new_id,
    sealed,
)
from engines.api.token_score import TokenScore
from engines.core.engine import TokenEvent


def token_logprobs(tokenizer: Any, scores: list[TokenScore]) -> list[dict[str, Any]]:
    """Each token's logprob and alternatives, as output_text carries them (chat's shape)."""
    if not scores:
        return []
    return [token.model_dump() for token in chat_logprobs(tokenizer, scores).content]


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """How a request wants its output: calls cut to `max_calls`; the thought also sealed
    into encrypted_content (`include: ["reasoning.encrypted_content"]`)."""

    max_calls: int | None = None
    seal_thoughts: bool = False


def reasoning_item(
    item_id: str, text: str, options: OutputOptions, status: str = "completed"
) -> ReasoningOutput:
    content = [ReasoningText(text=text)] if text else []
    secret = sealed(text) if options.seal_thoughts and text else None
    return ReasoningOutput(id=item_id, content=content, encrypted_content=secret, status=status)


def message_item(
    item_id: str, text: str, logprobs: list[dict[str, Any]], status: str = "completed"
) -> MessageOutput:
    return MessageOutput(
        id=item_id, status=status, content=[OutputText(text=text, logprobs=logprobs)]
    )


def kept_calls(calls: list[ToolCall], max_calls: int | None) -> list[ToolCall]:
    return calls if max_calls is None else calls[:max_calls]


def output_of(
    whole: Reply, logprobs: list[dict[str, Any]], finish_reason: str, options: OutputOptions
) -> list[OutputItem]:
    """The output items of a whole reply: its thought, its text (an empty message when it
    said and called nothing), its calls."""
    status = "incomplete" if finish_reason == "length" else "completed"
    items: list[OutputItem] = []
    said = bool(whole.content) or not whole.calls
    if whole.reasoning:  # cut short only when nothing came after it (as streamed)
        thought_status = "completed" if said else status
        items.append(reasoning_item(new_id("rs"), whole.reasoning, options, thought_status))
    if said:
        items.append(message_item(new_id("msg"), whole.content, logprobs, status))
    items += [FunctionCallOutput.of(call) for call in kept_calls(whole.calls, options.max_calls)]
    return items


def usage_of(tokenizer: Any, final: TokenEvent | Any, reasoning: str) -> ResponseUsage:
    """Usage from the final event (or an Outcome); reasoning tokens are the thought's text
    tokenized again (the engine counts tokens, not which part of the reply they went to)."""
    thought = len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    return ResponseUsage.counted(
        final.prompt_tokens, final.completion_tokens, final.cached_tokens, thought
    )
