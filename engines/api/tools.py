"""Tool calling: the model's tool-call format (from mlx-lm's parsers), checks, and parsing the
calls out of the generated text — whole or while streaming."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engines.api.conversation import ChatInput, FunctionTool, ToolCall
from engines.api.errors import APIError
from engines.api.loose_calls import FENCE, calls_in_json, fence_body, new_call_id, opens_call_fence

log = logging.getLogger(__name__)

# The name of a call cut short, before its JSON closes.
CALLED_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
ARGUMENTS_START = re.compile(r'"(?:arguments|parameters)"\s*:\s*')

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


def ends_in_calls(calls: Sequence[ToolCall]) -> bool:
    """The reply ended by calling tools (a call cut short by max_tokens did not)."""
    return bool(calls) and all(call.complete for call in calls)


def split_tool_calls(
    text: str, found: ToolFormat, tools: list[dict[str, Any]] | None
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
        cut_short = end < 0 and bool(found.end)  # the text ended before the end marker
        if call is None and cut_short:
            call = cut_short_call(body)  # never markup to the client
        if call is not None:
            calls.append(call)
        elif not cut_short:  # a call that does not parse: kept as text, not lost
            content.append(rest[start:] if end < 0 else rest[start : end + len(found.end)])
        if end < 0:
            break
        rest = rest[end + len(found.end) :]
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
    return ToolCall(id=new_call_id(), name=parsed["name"], arguments=arguments)


def cut_short_call(body: str) -> ToolCall | None:
    """A call whose text ended before its JSON closed (`max_tokens`): its name and the
    arguments written so far, marked incomplete; None when not even the name was written."""
    named = CALLED_NAME.search(body)
    if named is None:
        return None
    opened = ARGUMENTS_START.search(body, named.end()) or ARGUMENTS_START.search(body)
    arguments = body[opened.end() :] if opened else ""
    name = json.loads(f'"{named.group(1)}"')
    return ToolCall(id=new_call_id(), name=name, arguments=arguments, complete=False)


class ToolCallStream:
    """While streaming: pass text through, hold back what may be a call, collect calls.

    Three things may be a call. The template's start marker: held from there to the end and
    parsed at `finish`. With tools on offer, a reply that opens with `{` or `[` (held whole)
    and a ```json or bare ``` fence (held until it closes): calls written without the markers
    (engines/api/loose_calls.py), else released as the text they are. Other fences stream.
    """

    def __init__(self, found: ToolFormat, tools: Sequence[FunctionTool] = ()) -> None:
        self._found = found
        self._tools = tuple(tools)
        self._held = ""
        self._mode = "text"  # "text", "marker", "whole", "fence", "code"
        self._started = False  # the reply said something that is not a call
        self._calls: list[ToolCall] = []

    def feed(self, text: str) -> str:
        """The part of `text` that is plain content and safe to send now."""
        self._held += text
        ready: list[str] = []
        while self._mode not in ("marker", "whole"):
            if self._mode == "text" and not self._read_text(ready):
                break
            if self._mode == "fence" and not self._read_call_fence(ready):
                break
            if self._mode == "code" and not self._read_code(ready):
                break
        return "".join(ready)

    def finish(
        self, tools: list[dict[str, Any]] | None, single: bool
    ) -> tuple[str, list[ToolCall]]:
        """(content still held, the calls) once the generation has ended."""
        held, self._held = self._held, ""
        calls, content = list(self._calls), held
        if self._mode == "marker":
            content, more = split_tool_calls(held, self._found, tools)
            calls += more
        elif self._mode in ("whole", "fence"):
            body = held.strip() if self._mode == "whole" else held.partition("\n")[2]
            more = calls_in_json(body.removesuffix(FENCE), self._tools)
            if more:
                calls, content = calls + more, ""
        return content, calls[:1] if single else calls

    def _read_text(self, ready: list[str]) -> bool:
        """Plain text up to what may start a call; False when it must wait for more."""
        if self._tools and not self._started:
            stripped = self._held.lstrip()
            if not stripped:
                return False
            if stripped[0] in "{[":
                self._mode = "whole"
                return False
            self._started = True
        starts = [self._held.find(self._found.start)]
        if self._tools:
            starts.append(self._held.find(FENCE))
        found = [index for index in starts if index >= 0]
        if not found:
            keep = max(partial_suffix(self._held, self._found.start), self._fence_suffix())
            ready.append(self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
            return False
        first = min(found)
        ready.append(self._held[:first])
        self._held = self._held[first:]
        if first == starts[0]:
            self._mode = "marker"
            return False
        opening, newline, _ = self._held[len(FENCE) :].partition("\n")
        if not newline:
            return False  # the fence's language is not known yet
        self._mode = "fence" if opens_call_fence(opening) else "code"
        if self._mode == "code":
            cut = len(FENCE) + len(opening) + 1
            ready.append(self._held[:cut])
            self._held = self._held[cut:]
        return True

    def _read_call_fence(self, ready: list[str]) -> bool:
        close = self._held.find(FENCE, self._held.find("\n") + 1)
        if close < 0:
            return False
        block, self._held = self._held[: close + len(FENCE)], self._held[close + len(FENCE) :]
        calls = calls_in_json(fence_body(block) or "", self._tools)
        if calls:
            self._calls += calls
        else:
            ready.append(block)
        self._mode = "text"
        return True

    def _read_code(self, ready: list[str]) -> bool:
        """Inside a code fence: stream it, up to its closing backticks."""
        close = self._held.find(FENCE)
        if close < 0:
            keep = self._fence_suffix()
            ready.append(self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
            return False
        cut = close + len(FENCE)
        ready.append(self._held[:cut])
        self._held = self._held[cut:]
        self._mode = "text"
        return True

    def _fence_suffix(self) -> int:
        return partial_suffix(self._held, FENCE) if self._tools else 0


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
