"""The call guard (engines/api/call_guard.py) on a real tokenizer and llguidance's own matcher:
free text stays free, and a call, once it names a tool on offer, must be valid JSON of that
tool's schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llguidance
import pytest
from mlx_lm.utils import load_tokenizer

from engines.api.call_guard import call_guard
from engines.api.conversation import ChatInput, FunctionTool, OutputFormat, Turn
from engines.api.tools import ToolFormat
from engines.decoding.grammar import GrammarCompiler

EDIT_SCHEMA = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {
        "file_path": {"type": "string"},
        "old_string": {"type": "string"},
        "new_string": {"type": "string"},
        "replace_all": {"type": "boolean", "default": False},
    },
    "required": ["file_path", "old_string", "new_string"],
    "additionalProperties": False,
}
EDIT = FunctionTool("Edit", "Replace old_string with new_string", EDIT_SCHEMA)
READ_SCHEMA = {"type": "object", "properties": {"file_path": {"type": "string"}}}
READ = FunctionTool("Read", None, READ_SCHEMA)
ASK = (Turn("user", "fix calc.py"),)
GOOD_EDIT = '{"name": "Edit", "arguments": {"file_path": "/w/calc.py", "old_string": "len(v) + 1", "new_string": "len(v)"}}'  # noqa: E501


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> Any:
    return load_tokenizer(demo_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer))


def guard_of(tokenizer: Any, **chat: Any) -> str | None:
    found = ToolFormat.of(tokenizer)
    return call_guard(ChatInput(ASK, **{"tools": (EDIT, READ), **chat}), tokenizer, found)


def refused_at(compiler: GrammarCompiler, grammar: str, tokenizer: Any, text: str) -> str | None:
    """The text up to the first token the guard refuses; None when all of `text` passes and
    the reply may end there."""
    matcher = llguidance.LLMatcher(compiler._llg_tokenizer(), grammar, log_level=0)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    for index, token in enumerate(tokens):
        if not matcher.consume_token(token):
            return tokenizer.decode(tokens[: index + 1])
    return None if matcher.is_accepting() else text


def test_prose_and_code_stay_free(tokenizer: Any, compiler: GrammarCompiler) -> None:
    grammar = guard_of(tokenizer)
    assert grammar is not None
    prose = 'The bug is in average():\n```python\nreturn sum(v) / len(v)\n```\n{"name": "Ann"}'
    assert refused_at(compiler, grammar, tokenizer, prose) is None


@pytest.mark.parametrize(
    "wrapped",
    [
        GOOD_EDIT,
        f"```json\n{GOOD_EDIT}\n```",
        f"I will edit it.\n<tool_call>\n{GOOD_EDIT}\n</tool_call>",
    ],
)
def test_a_call_that_keeps_to_its_schema_passes(
    tokenizer: Any, compiler: GrammarCompiler, wrapped: str
) -> None:
    assert refused_at(compiler, guard_of(tokenizer) or "", tokenizer, wrapped) is None


def test_a_string_with_an_unescaped_quote_is_refused(
    tokenizer: Any, compiler: GrammarCompiler
) -> None:
    """What Qwen2.5-Coder-1.5B wrote for Claude Code's Edit: a docstring's three quotes, not
    escaped, inside a JSON string."""
    docstring = '"' * 3 + "Return the mean." + '"' * 3
    broken = (
        f'{{"name": "Edit", "arguments": {{"file_path": "/w/calc.py", "old_string": "{docstring}'
    )
    refused = refused_at(compiler, guard_of(tokenizer) or "", tokenizer, broken)
    assert refused is not None and len(refused) < len(broken)  # refused inside, not at the end


def test_a_call_without_a_required_argument_cannot_end(
    tokenizer: Any, compiler: GrammarCompiler
) -> None:
    """What Qwen2.5-Coder-0.5B wrote: an Edit without its file_path."""
    missing = '{"name": "Edit", "arguments": {"old_string": "a", "new_string": "b"}}'
    assert refused_at(compiler, guard_of(tokenizer) or "", tokenizer, missing) is not None


def test_arguments_may_be_compact_or_indented(tokenizer: Any, compiler: GrammarCompiler) -> None:
    indented = (
        '```json\n{\n  "name": "Read",\n  "arguments": {\n    "file_path": "/w/a"\n  }\n}\n```'
    )
    compact = '{"name":"Read","arguments":{"file_path":"/w/a.py"}}'
    grammar = guard_of(tokenizer) or ""
    assert refused_at(compiler, grammar, tokenizer, indented) is None
    assert refused_at(compiler, grammar, tokenizer, compact) is None


def test_no_guard_where_another_grammar_binds_or_no_call_can_come(tokenizer: Any) -> None:
    assert guard_of(tokenizer, tool_mode="required") is None  # the forced call's own grammar
    assert guard_of(tokenizer, output_format=OutputFormat()) is None  # JSON mode's
    assert guard_of(tokenizer, tool_mode="none") is None
    assert guard_of(tokenizer, tools=()) is None
    assert guard_of(tokenizer, tools=(FunctionTool("say hi"),)) is None  # a name it cannot spell
