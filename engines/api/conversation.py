"""ChatInput: a conversation, the tools on offer and the output asked for, whatever the dialect.

Every dialect (chat completions, Messages, Responses, Ollama) maps its body onto this one
value; prompts, tool calls and output grammars read only it. Each field remembers the body's
own name for it (`FieldNames`), so an error names what the caller actually sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

ToolMode = Literal["auto", "none", "required"]


@dataclass(frozen=True, slots=True)
class FieldNames:
    """The body's name for each part of the input, for the 400 that names it."""

    messages: str = "messages"
    tools: str = "tools"
    tool_choice: str = "tool_choice"
    output_format: str = "response_format"
    schema: str = "response_format.json_schema.schema"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call to one of the tools: made by the model, or replayed from an earlier turn."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI carries it
    complete: bool = True  # False: cut short by max_tokens, `arguments` as far as written

    def arguments_value(self) -> Any:
        """The arguments as an object, as chat templates render them (`arguments | tojson`)."""
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments


@dataclass(frozen=True, slots=True)
class Turn:
    """One message of the conversation, in the roles chat templates know."""

    role: str  # "system", "developer", "user", "assistant" or "tool"
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # the call a tool turn answers
    name: str | None = None
    reasoning: str | None = None  # an assistant turn's earlier thinking, passed back


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema

    def template_form(self) -> dict[str, Any]:
        """The tool as chat templates expect it (OpenAI's function-tool shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """JSON output: any object (schema None) or one matching a JSON schema."""

    schema: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ChatInput:
    """What a chat request asks for, whatever dialect it came in."""

    turns: tuple[Turn, ...]
    tools: tuple[FunctionTool, ...] = ()
    tool_mode: ToolMode = "auto"
    forced_tool: str | None = None  # a call to this tool is required (tool_mode "required")
    parallel_tool_calls: bool = True
    output_format: OutputFormat | None = None
    thinking: bool | None = None  # False: turn the template's thinking off; None: its default
    template_options: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs
    names: FieldNames = FieldNames()

    def forces_call(self) -> bool:
        """A tool call is required (of any tool on offer, or of `forced_tool`)."""
        return bool(self.tools) and self.tool_mode == "required"

    def grammar_param(self) -> str | None:
        """The body's field that asks for an output grammar (a forced call, JSON), if any."""
        if self.forces_call():
            return self.names.tool_choice
        return self.names.output_format if self.output_format is not None else None

    def resolved_thinking(self) -> bool | None:
        """`thinking`, except that a grammar-shaped output (JSON, a forced call) never thinks:
        the grammar binds from the first token, so a thought could not be written."""
        if self.output_format is not None or self.forces_call():
            return False
        return self.thinking

    def single_call(self) -> bool:
        """At most one call: parallel calls off, or a forced call (its grammar allows one)."""
        return not self.parallel_tool_calls or self.forces_call()

    def offered_tools(self) -> list[FunctionTool]:
        """The tools the model may call (none when tool_mode is "none")."""
        return list(self.tools) if self.tools and self.tool_mode != "none" else []

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates expect them (None: no tools, or tool_mode "none")."""
        if not self.tools or self.tool_mode == "none":
            return None
        return [tool.template_form() for tool in self.tools]

    def text_length(self) -> int:
        """Characters the prompt surely holds (the contents and the tools): a cheap lower
        bound on its length, for refusing a prompt too long before templating it."""
        offered = sum(len(json.dumps(tool)) for tool in self.template_tools() or ())
        return offered + sum(len(turn.content) for turn in self.turns)
