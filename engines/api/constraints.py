"""The output grammar of a chat request: JSON mode, a JSON schema, or a forced tool call —
compiled to an llguidance grammar the engine applies as a logits processor."""

from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher

from engines.api.conversation import ChatInput
from engines.api.errors import APIError
from engines.api.tools import ToolFormat

# Compact JSON: a model that may emit whitespace forever (a small or random one) cannot stall
# inside the object; the result is the same JSON.
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_OBJECT = {"type": "object"}


def output_grammar(chat: ChatInput, tokenizer: Any, tools: ToolFormat | None) -> str | None:
    """The grammar the output must match, or None; 400 naming the field for a bad schema."""
    if tools is not None and chat.forces_call():
        return _tool_call_grammar(chat, tokenizer, tools)
    if chat.output_format is None:
        return None
    schema = chat.output_format.schema
    param = chat.names.output_format if schema is None else chat.names.schema
    try:
        grammar = LLMatcher.grammar_from_json_schema(
            ANY_OBJECT if schema is None else schema, overrides=JSON_OPTIONS
        )
    except ValueError as error:
        raise APIError(
            400, f"invalid JSON schema: {error}", param=param, code="invalid_value"
        ) from error
    return _checked(grammar, param)


def _tool_call_grammar(chat: ChatInput, tokenizer: Any, tools: ToolFormat) -> str:
    """`<tool_call>{"name": one of the tools, "arguments": its parameters}</tool_call>`."""
    offered = [tool for tool in chat.tools if chat.forced_tool in (None, tool.name)]
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                "arguments": ANY_OBJECT if tool.parameters is None else tool.parameters,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in offered
    ]
    call_schema = {"anyOf": calls} if len(calls) > 1 else calls[0]
    schema = {**call_schema, "x-guidance": JSON_OPTIONS}
    lark = (
        f'start: {_literal(tokenizer, tools.start)} "\\n" call "\\n" '
        f"{_literal(tokenizer, tools.end)}\n"
        f"call: %json {json.dumps(schema)}\n"
    )
    return _checked(LLMatcher.grammar_from_lark(lark), chat.names.tools)


def _literal(tokenizer: Any, marker: str) -> str:
    """A marker in lark: its special token by id when it is one, else the text."""
    return special_token_literal(tokenizer, marker) or json.dumps(marker)


def special_token_literal(tokenizer: Any, marker: str) -> str | None:
    """`<[id]>`, the lark for a marker that is one special token; None when it is text."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    special = set(getattr(tokenizer, "all_special_ids", ()))
    if len(ids) == 1 and (
        ids[0] in special or marker in getattr(tokenizer, "added_tokens_encoder", {})
    ):
        return f"<[{ids[0]}]>"
    return None


def _checked(grammar: str, param: str) -> str:
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        reason = messages[0] if messages else "invalid grammar"
        raise APIError(
            400, f"cannot constrain the output: {reason}", param=param, code="invalid_value"
        )
    return grammar
