"""Prompts to token ids: chat messages through the chat template, completion prompts as given."""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from .errors import APIError
from .schemas import ChatMessage

DEFAULT_MAX_PROMPT_TOKENS = 32768

# Templates written before OpenAI's "developer" role know it as "system".
_TEMPLATE_ROLES = {"developer": "system"}


def chat_prompt_tokens(
    tokenizer: Any, messages: list[ChatMessage], max_prompt_tokens: int
) -> tuple[int, ...]:
    """Render the conversation with the model's chat template, ending in the assistant's turn."""
    conversation = [
        {"role": _TEMPLATE_ROLES.get(message.role, message.role), "content": message.text()}
        for message in messages
    ]
    if getattr(tokenizer, "has_chat_template", False):
        try:
            tokens = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
        except (TemplateError, ValueError) as error:
            raise APIError(
                400, f"the model's chat template rejected the messages: {error}", param="messages"
            ) from error
    else:
        tokens = tokenizer.encode(_plain_transcript(conversation))
    return _checked(tokens, max_prompt_tokens, "messages")


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
    return _checked(tokenizer.encode(text), max_prompt_tokens, "prompt")


def _plain_transcript(conversation: list[dict[str, str]]) -> str:
    # Only for tokenizers without a chat template: a readable transcript the model continues.
    lines = [f"{turn['role']}: {turn['content']}" for turn in conversation]
    return "\n".join([*lines, "assistant:"])


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
