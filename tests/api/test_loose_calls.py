"""Tool calls written without the template's markers (engines/api/loose_calls.py), and a call cut
short: read by ReplyStream on a tool-calling tokenizer, streamed at every cut and whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.utils import load_tokenizer

from engines.api.conversation import ChatInput, FunctionTool, Turn
from engines.api.reply import Reply, ReplyStream
from engines.api.tools import ToolFormat, ends_in_calls

WEATHER = FunctionTool(
    "get_weather",
    "the weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
ASK = (Turn("user", "What is the weather in Paris?"),)
BARE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
PYTHON = "Here is the code:\n```python\nprint({'a': 1})\n```\nDone."


@pytest.fixture(scope="module")
def tool_format(thinking_model_dir: Path) -> ToolFormat:
    found = ToolFormat.of(load_tokenizer(thinking_model_dir))
    assert found is not None and found.start == "<tool_call>"
    return found


def read(text: str, tool_format: ToolFormat, tools: tuple[FunctionTool, ...] = (WEATHER,)) -> Reply:
    """The reply read whole, after checking that every two-piece stream of it reads the same."""
    chat = ChatInput(ASK, tools=list(tools))
    whole = ReplyStream(chat, tool_format).read_whole(text)
    for cut in range(len(text) + 1):
        stream = ReplyStream(chat, tool_format)
        pieces = stream.feed(text[:cut]) + stream.feed(text[cut:])
        rest, calls = stream.finish()
        content = "".join(piece.text for piece in pieces + rest)
        assert content == whole.content, f"cut at {cut}"
        assert [(c.name, c.arguments) for c in calls] == [
            (c.name, c.arguments) for c in whole.calls
        ], f"cut at {cut}"
    return whole


def named(reply: Reply) -> list[tuple[str, Any]]:
    return [(call.name, json.loads(call.arguments)) for call in reply.calls]


@pytest.mark.parametrize(
    "text",
    [
        BARE,
        f"  \n{BARE}\n",
        f"```json\n{BARE}\n```",
        f"```\n{BARE}\n```",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
    ],
)
def test_a_call_without_markers_is_a_call(text: str, tool_format: ToolFormat) -> None:
    reply = read(text, tool_format)
    assert named(reply) == [("get_weather", {"city": "Paris"})]
    assert reply.content.strip() == ""
    assert ends_in_calls(reply.calls)


def test_text_around_a_fenced_call_stays_text(tool_format: ToolFormat) -> None:
    reply = read(f"I will look it up.\n```json\n{BARE}\n```\nOne moment.", tool_format)
    assert named(reply) == [("get_weather", {"city": "Paris"})]
    assert reply.content == "I will look it up.\n\nOne moment."


def test_an_array_of_calls_is_every_call(tool_format: ToolFormat) -> None:
    lyon = BARE.replace("Paris", "Lyon")
    reply = read(f"[{BARE}, {lyon}]", tool_format)
    assert named(reply) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_time", "arguments": {"city": "Paris"}}',  # no such tool offered
        '{"name": "get_weather", "arguments": {"town": "Paris"}}',  # "city" is required
        '{"name": "get_weather", "arguments": {"city": 7}}',  # not a string
        '{"name": "get_weather", "arguments": {"city": "Paris"}, "note": "hi"}',  # not only a call
        '{"name": "get_weather", "arguments": {"city": "Par',  # not JSON
        f"```python\n{BARE}\n```",  # a fence of another language is code
        f"The call would be {BARE}",  # JSON inside prose is prose
        PYTHON,
    ],
)
def test_what_is_not_wholly_a_call_stays_the_text_it_was(
    text: str, tool_format: ToolFormat
) -> None:
    reply = read(text, tool_format)
    assert reply.calls == []
    assert reply.content == text


def test_without_tools_on_offer_json_is_text(tool_format: ToolFormat) -> None:
    reply = read(BARE, tool_format, tools=())
    assert reply.calls == [] and reply.content == BARE


def test_a_code_fence_streams_before_it_closes(tool_format: ToolFormat) -> None:
    stream = ReplyStream(ChatInput(ASK, tools=[WEATHER]), tool_format)
    sent = "".join(piece.text for piece in stream.feed("Here:\n```python\nprint(1)\nprint(2)"))
    assert sent == "Here:\n```python\nprint(1)\nprint(2)"


def test_a_call_cut_short_is_an_incomplete_call_never_markup(tool_format: ToolFormat) -> None:
    reply = read('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', tool_format)
    assert reply.content == ""
    [call] = reply.calls
    assert (call.name, call.arguments, call.complete) == ("get_weather", '{"city": "Pa', False)
    assert not ends_in_calls(reply.calls)


def test_a_call_cut_before_its_name_leaves_nothing(tool_format: ToolFormat) -> None:
    reply = read('<tool_call>\n{"na', tool_format)
    assert reply.content == "" and reply.calls == []
