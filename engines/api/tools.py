"""Tool calling: the model's tool-call format (from mlx-lm's parsers), checks, and parsing the
calls out of the generated text — whole or while streaming."""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from engines.api.conversation import ChatInput, ToolCall
from engines.api.errors import APIError

log = logging.getLogger(__name__)

# The one format whose calls tandem can also force (tool_choice "required" or a named
# function) with a grammar: <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
JSON_TOOLS = "json_tools"


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How this model's chat template marks a tool call, and mlx-lm's parser for its body."""

    kind: str  # mlx-lm's tool_parser_type: "json_tools", "qwen3_coder", "mistral", ...
    start: str
    end: str
    parser: Any  # parse_tool_call(text, tools) -> {"name": ..., "arguments": ...}

    @classmethod
    def of(cls, tokenizer: Any) -> ToolFormat | None:
        """None when the template has no tool support mlx-lm knows."""
        if not getattr(tokenizer, "has_tool_calling", False):
            return None
        kind = getattr(tokenizer, "init_kwargs", {}).get("tool_parser_type", "")
        return cls(kind, tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser)


def tool_format_for(chat: ChatInput, tokenizer: Any) -> ToolFormat | None:
    """The format to parse calls with (None: the request offers no tools); 400 when the model
    cannot take tools or the tool choice cannot be honoured."""
    if not chat.tools:
        return None
    names = chat.names
    found = ToolFormat.of(tokenizer)
    if found is None:
        message = "this model's chat template has no tool-call support, so it cannot take tools"
        raise APIError(400, message, param=names.tools, code="unsupported_parameter")
    offered = [tool.name for tool in chat.tools]
    if chat.forced_tool is not None and chat.forced_tool not in offered:
        message = f"{names.tool_choice} names '{chat.forced_tool}', which is not in tools {offered}"
        raise APIError(400, message, param=names.tool_choice, code="invalid_value")
    if chat.forces_call() and found.kind != JSON_TOOLS:
        message = (
            f"forcing a tool call works for templates that call tools as <tool_call>{{json}}"
            f"</tool_call>; this model's format is '{found.kind}' (let the model choose instead)"
        )
        raise APIError(400, message, param=names.tool_choice, code="unsupported_parameter")
    return found


def split_tool_calls(
    text: str, found: ToolFormat, tools: list[dict[str, Any]] | None, single: bool = False
) -> tuple[str, list[ToolCall]]:
    """(the text outside the calls, the calls) for a whole generation."""
    content: list[str] = []
    calls: list[ToolCall] = []
    rest = text
    while True:
        start = rest.find(found.start)
        if start < 0:
            content.append(rest)
            break
        content.append(rest[:start])
        body_start = start + len(found.start)
        end = rest.find(found.end, body_start) if found.end else -1
        body = rest[body_start:] if end < 0 else rest[body_start:end]
        call = parse_call(body, found, tools, len(calls))
        if call is None:  # unparseable: keep it as text rather than lose it
            content.append(rest[start:] if end < 0 else rest[start : end + len(found.end)])
        else:
            calls.append(call)
        if end < 0:
            break
        rest = rest[end + len(found.end) :]
    if single:
        calls = calls[:1]
    return "".join(content), calls


def parse_call(
    body: str, found: ToolFormat, tools: list[dict[str, Any]] | None, index: int
) -> ToolCall | None:
    try:
        parsed = found.parser(body, tools)
    except Exception as error:  # a truncated or malformed call: mlx-lm's parsers raise anything
        log.info("could not parse tool call %d (%s): %r", index, error, body[:200])
        return None
    if isinstance(parsed, list):  # some formats put several calls in one block
        parsed = parsed[0] if parsed else None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=parsed["name"], arguments=arguments)


class ToolCallStream:
    """While streaming: pass text through, hold back what may start a call, collect calls.

    Text that could be the beginning of the start marker is held until it is not; from the
    marker on, everything is kept until the end, where `finish` parses it.
    """

    def __init__(self, found: ToolFormat) -> None:
        self._found = found
        self._held = ""
        self._in_call = False

    def feed(self, text: str) -> str:
        """The part of `text` that is plain content and safe to send now."""
        if self._in_call:
            self._held += text
            return ""
        self._held += text
        start = self._held.find(self._found.start)
        if start >= 0:
            self._in_call = True
            ready, self._held = self._held[:start], self._held[start:]
            return ready
        keep = partial_suffix(self._held, self._found.start)
        ready = self._held[: len(self._held) - keep]
        self._held = self._held[len(ready) :]
        return ready

    def finish(
        self, tools: list[dict[str, Any]] | None, single: bool
    ) -> tuple[str, list[ToolCall]]:
        """(content still held, the calls) once the generation has ended."""
        held, self._held = self._held, ""
        if not self._in_call:
            return held, []
        return split_tool_calls(held, self._found, tools, single)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
