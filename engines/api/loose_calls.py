"""Tool calls a model writes without its template's markers.

Small instruct models offered tools often answer with the call's JSON alone, bare or in a
```json fence, instead of inside <tool_call> tags (Qwen2.5-Coder-0.5B and -1.5B do, measured
in docs/api.md). Such text is taken as a call when all of it is calls: one JSON object, or an
array of them, each naming a tool on offer, with `arguments` (or `parameters`) that fit that
tool's schema. Anything else stays text, as the model wrote it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from engines.api.conversation import FunctionTool, ToolCall

FENCE = "```"
CALL_FENCE_LANGUAGES = ("", "json")  # ```json or a bare ``` fence may hold a call
ARGUMENT_KEYS = ("arguments", "parameters")  # the template's word, and Llama's


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def calls_in_json(text: str, tools: Iterable[FunctionTool]) -> list[ToolCall] | None:
    """The calls `text` makes when it is nothing but calls of offered tools, else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    offered = {tool.name: tool for tool in tools}
    calls = [_call_of(item, offered) for item in items]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def fence_body(block: str) -> str | None:
    """The inside of a whole fenced block that may hold a call (```json or ```), else None."""
    if not (block.startswith(FENCE) and block.endswith(FENCE)) or len(block) < 2 * len(FENCE):
        return None
    opening, _, rest = block[len(FENCE) :].partition("\n")
    if opening.strip().lower() not in CALL_FENCE_LANGUAGES:
        return None
    return rest[: -len(FENCE)]


def opens_call_fence(opening_line: str) -> bool:
    """Whether a fence's opening line (without the backticks) may start a call."""
    return opening_line.strip().lower() in CALL_FENCE_LANGUAGES


def _call_of(item: Any, offered: dict[str, FunctionTool]) -> ToolCall | None:
    if not isinstance(item, dict) or item.get("name") not in offered:
        return None
    found = [key for key in ARGUMENT_KEYS if key in item]
    if set(item) - {"name", *found} or len(found) > 1:
        return None  # other keys: an object that mentions a tool, not a call
    arguments = item[found[0]] if found else {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict) or not _fits(arguments, offered[item["name"]].parameters):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), name=item["name"], arguments=text)


def _fits(arguments: dict[str, Any], schema: dict[str, Any] | None) -> bool:
    if not schema:
        return True
    try:
        return Draft202012Validator(schema).is_valid(arguments)
    except SchemaError:  # a schema the validator cannot read: the name and an object suffice
        return True
