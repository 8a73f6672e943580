"""The output grammar of a chat request: JSON mode, a JSON schema, or a forced tool call —
compiled to an llguidance grammar the engine applies as a logits processor."""

from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher

from engines.api.errors import APIError
from engines.api.schemas import ChatCompletionRequest
from engines.api.tools import ToolFormat, forces_call

# Compact JSON: a model that may emit whitespace forever (a small or random one) cannot stall
# inside the object; the result is the same JSON.
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_OBJECT = {"type": "object"}


def output_grammar(
    body: ChatCompletionRequest, tokenizer: Any, tools: ToolFormat | None
) -> str | None:
    """The grammar the output must match, or None; 400 naming the field for a bad schema."""
    if tools is not None and forces_call(body):
        return _tool_call_grammar(body, tokenizer, tools)
    requested = body.response_format
    if requested is None or requested.type == "text":
        return None
    if requested.type == "json_object":
        return _checked(
            LLMatcher.grammar_from_json_schema(ANY_OBJECT, overrides=JSON_OPTIONS),
            "response_format",
        )
    schema = requested.json_schema.json_schema
    param = "response_format.json_schema.schema"
    document = ANY_OBJECT if schema is None else schema.model_dump()
    try:
        grammar = LLMatcher.grammar_from_json_schema(document, overrides=JSON_OPTIONS)
    except ValueError as error:
        raise APIError(
            400, f"invalid JSON schema: {error}", param=param, code="invalid_value"
        ) from error
    return _checked(grammar, param)


def _tool_call_grammar(body: ChatCompletionRequest, tokenizer: Any, tools: ToolFormat) -> str:
    """`<tool_call>{"name": one of the tools, "arguments": its parameters}</tool_call>`."""
    choice = body.tool_choice
    offered = body.tools or []
    if not isinstance(choice, str | None):
        offered = [tool for tool in offered if tool.function.name == choice.function.name]
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "arguments": ANY_OBJECT
                if tool.function.parameters is None
                else tool.function.parameters.model_dump(),
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
    return _checked(LLMatcher.grammar_from_lark(lark), "tools")


def _literal(tokenizer: Any, marker: str) -> str:
    """A marker in lark: its special token by id when it is one, else the text."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    special = set(getattr(tokenizer, "all_special_ids", ()))
    if len(ids) == 1 and (
        ids[0] in special or marker in getattr(tokenizer, "added_tokens_encoder", {})
    ):
        return f"<[{ids[0]}]>"
    return json.dumps(marker)


def _checked(grammar: str, param: str) -> str:
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        reason = messages[0] if messages else "invalid grammar"
        raise APIError(
            400, f"cannot constrain the output: {reason}", param=param, code="invalid_value"
        )
    return grammar
