"""Prompts to token ids: chat messages through the chat template, completion prompts as given."""

from __future__ import annotations

import functools
from typing import Any

from jinja2 import TemplateError

from engines.api.conversation import ChatInput, Turn
from engines.api.errors import APIError

DEFAULT_MAX_PROMPT_TOKENS = 32768
NO_CHAT_TEMPLATE = (
    "this model has no chat template (a base model), so it cannot turn messages into a prompt: "
    'send the prompt as text to /v1/completions (or Ollama\'s /api/generate with "raw": true), '
    "or start `tandem serve` with --chat-template FILE (a Jinja chat template)"
)

# Templates written before OpenAI's "developer" role know it as "system".
_TEMPLATE_ROLES = {"developer": "system"}


def chat_prompt_tokens(tokenizer: Any, chat: ChatInput, max_prompt_tokens: int) -> tuple[int, ...]:
    """Render the conversation (and the tools on offer) with the model's chat template, ending
    in the assistant's turn."""
    param = chat.names.messages
    check_chat_template(tokenizer, param)
    check_prompt_size(tokenizer, chat.text_length(), max_prompt_tokens, param)
    conversation = [_template_message(turn) for turn in chat.turns]
    options = dict(chat.template_options)
    tools = chat.template_tools()
    if tools:
        options["tools"] = tools
    thinking = chat.resolved_thinking()
    if thinking is not None:  # mlx-lm renames it for templates that say `thinking`
        options["enable_thinking"] = thinking
    try:
        tokens = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, **options)
    except (TemplateError, ValueError, TypeError) as error:
        raise APIError(
            400, f"the model's chat template rejected the messages: {error}", param=param
        ) from error
    return _checked(tokens, max_prompt_tokens, param)


def check_chat_template(tokenizer: Any, param: str) -> None:
    """Refuse chat to a model without a chat template (a base model), as vLLM does: any
    transcript tandem made up would be one the model was never trained on."""
    if not getattr(tokenizer, "has_chat_template", False):
        raise APIError(400, NO_CHAT_TEMPLATE, param=param, code="chat_template_missing")


def completion_prompt_tokens(
    tokenizer: Any, prompt: str | list[str] | list[int], max_prompt_tokens: int
) -> tuple[int, ...]:
    """A text prompt is encoded (with the tokenizer's BOS); a token list is taken as is."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        vocabulary = len(tokenizer)
        bad = [token for token in prompt if not 0 <= token < vocabulary]
        if bad:
            raise APIError(
                400,
                f"prompt token ids must be in [0, {vocabulary}); got {bad[:5]}",
                param="prompt",
                code="invalid_value",
            )
        return _checked(prompt, max_prompt_tokens, "prompt")
    text = prompt if isinstance(prompt, str) else prompt[0]
    if not text:
        raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    check_prompt_size(tokenizer, len(text), max_prompt_tokens, "prompt")
    return _checked(tokenizer.encode(text), max_prompt_tokens, "prompt")


def check_prompt_size(tokenizer: Any, text_length: int, max_prompt_tokens: int, param: str) -> None:
    """Refuse, before tokenizing, a prompt whose characters alone prove it too long.

    No token is longer than the tokenizer's longest vocabulary entry, so a prompt of N
    characters has at least N / longest tokens: a bound that costs nothing to check.
    """
    limit = max_prompt_tokens * longest_token_chars(tokenizer)
    if text_length > limit:
        raise APIError(
            400,
            f"'{param}' has {text_length} characters: more than the {max_prompt_tokens} prompt "
            f"tokens this server accepts can hold (at most {limit} characters)",
            param=param,
            code="context_length_exceeded",
        )


@functools.lru_cache(maxsize=4)
def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for in this tokenizer (at least 1)."""
    vocabulary = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max((len(token) for token in vocabulary), default=1) or 1


def _template_message(turn: Turn) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": _TEMPLATE_ROLES.get(turn.role, turn.role),
        "content": turn.content,
    }
    if turn.name is not None:
        message["name"] = turn.name
    if turn.tool_call_id is not None:
        message["tool_call_id"] = turn.tool_call_id
    if turn.reasoning:
        message["reasoning_content"] = turn.reasoning  # what thinking templates read back
    if turn.tool_calls:
        # Templates render the arguments as an object (`arguments | tojson`), not as text.
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments_value()},
            }
            for call in turn.tool_calls
        ]
    return message


def _checked(tokens: Any, max_prompt_tokens: int, param: str) -> tuple[int, ...]:
    ids = tuple(int(token) for token in tokens)
    if not ids:
        raise APIError(400, f"'{param}' gives an empty prompt", param=param, code="invalid_value")
    if len(ids) > max_prompt_tokens:
        raise APIError(
            400,
            f"'{param}' comes to {len(ids)} prompt tokens; this server accepts at most "
            f"{max_prompt_tokens}",
            param=param,
            code="context_length_exceeded",
        )
    return ids
