"""The call guard: a lazy grammar for a reply that may call a tool (tool_choice "auto").

The reply stays free text until it begins a call — `{"name": "<a tool on offer>"` — and from
there the call must be valid JSON that keeps to that tool's schema. A small model writes its
calls well enough to be recognised but not always well enough to parse: Qwen2.5-Coder-1.5B
left a quote unescaped inside Claude Code's Edit arguments, and the 0.5B left out a required
`file_path` (docs/api.md, "On real weights"). llama.cpp's server guards calls the same way
(its lazy grammars, triggered by a tool-call opening).

The trigger is the call's opening itself, whether the model wraps it in the template's
<tool_call> markers, in a ```json fence or in nothing: the free text ends lazily, at the first
point where the opening of a call is complete. A JSON object naming anything but an offered
tool stays free.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from llguidance import LLMatcher

from engines.api.constraints import ANY_OBJECT, special_token_literal
from engines.api.conversation import ChatInput, FunctionTool
from engines.api.tools import JSON_TOOLS, ToolFormat

log = logging.getLogger(__name__)

# Tool names the trigger can spell in a regex as they are (OpenAI's and Anthropic's rule).
PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
WHITESPACE = r"[ \t\n]*"
# Inside the arguments: the model's own spacing, compact or indented, but bounded, so that a
# model that would write whitespace forever cannot stall inside the call.
ARGUMENT_JSON_OPTIONS = {
    "whitespace_flexible": True,
    "whitespace_pattern": r"[ \t\n]{0,40}",
    "lenient": True,  # a keyword the compiler does not know narrows nothing, and fails nothing
    "coerce_one_of": True,
}


def call_guard(chat: ChatInput, tokenizer: Any, tools: ToolFormat | None) -> str | None:
    """The guard's grammar for this request, or None: no tools on offer, a call forced (its
    own grammar binds), an output format asked for, a template whose calls are not JSON, or
    a tool the guard cannot spell or compile (the reply is then unguarded, never refused)."""
    offered = chat.offered_tools()
    if (
        tools is None
        or tools.kind != JSON_TOOLS
        or not offered
        or chat.forces_call()
        or chat.output_format is not None
    ):
        return None
    if not all(PLAIN_NAME.fullmatch(tool.name) for tool in offered):
        return None
    markers = [special_token_literal(tokenizer, marker) for marker in (tools.start, tools.end)]
    grammar = LLMatcher.grammar_from_lark(_lark(offered, [m for m in markers if m]))
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        log.info("tool calls unguarded: %s", messages[0] if messages else "invalid grammar")
        return None
    return grammar


def _lark(offered: list[FunctionTool], special_markers: list[str]) -> str:
    """Pieces of free text, each ending in a call (or in a special marker token, which free
    text cannot hold), then free text to the end."""
    calls = [f"call_{index}" for index in range(len(offered))]
    lines = [
        "%llguidance {}",
        "start: piece* TEXT",
        "piece: " + " | ".join(calls + [f"TEXT {marker}" for marker in special_markers]),
        "TEXT: /(?s:.*)/",
    ]
    for index, tool in enumerate(offered):
        opening = rf'(?s:.*)\{{{WHITESPACE}"name"{WHITESPACE}:{WHITESPACE}"{re.escape(tool.name)}"'
        schema = {**(tool.parameters or ANY_OBJECT), "x-guidance": ARGUMENT_JSON_OPTIONS}
        lines += [
            f"opening_{index}[lazy]: /{opening}/",
            f'call_{index}: opening_{index} /{WHITESPACE},{WHITESPACE}"(arguments|parameters)"'
            f'{WHITESPACE}:{WHITESPACE}/ arguments_{index} /{WHITESPACE}\\}}/',
            f"arguments_{index}: %json {json.dumps(schema)}",
        ]
    return "\n".join(lines) + "\n"
