"""ReplyStream on the thinking demo model's tokenizer: reasoning and content split by the think
markers wherever the deltas cut them, tool calls after a thought, and the stream's start."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.utils import load_tokenizer

from engines.api.conversation import ChatInput, FunctionTool, OutputFormat, Turn
from engines.api.reply import Piece, ReplyStream, ThinkMarkers
from engines.api.tools import ToolFormat

MARKERS = ThinkMarkers("<think>", "</think>")
HELLO = (Turn("user", "Hello"),)
WEATHER = FunctionTool(
    "get_weather",
    "the weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(thinking_model_dir: Path) -> Any:
    return load_tokenizer(thinking_model_dir)


def fed(stream: ReplyStream, deltas: list[str]) -> tuple[list[Piece], list[Any]]:
    """Every piece the stream gives out for `deltas`, then its held pieces and its calls."""
    pieces = [piece for delta in deltas for piece in stream.feed(delta)]
    rest, calls = stream.finish()
    return pieces + rest, calls


def joined(pieces: list[Piece], kind: str) -> str:
    return "".join(piece.text for piece in pieces if piece.kind == kind)


def test_the_thinking_tokenizer_knows_its_markers(tokenizer: Any) -> None:
    assert tokenizer.has_thinking
    assert ThinkMarkers.of(tokenizer, ChatInput(HELLO)) == MARKERS


def test_markers_split_across_deltas_never_leak() -> None:
    stream = ReplyStream(ChatInput(HELLO), None, MARKERS, thinking=False)
    pieces, calls = fed(stream, ["<th", "ink>a tho", "ught</thi", "nk>\n\nthe ", "answer"])
    assert joined(pieces, "reasoning") == "a thought"
    assert joined(pieces, "content") == "\n\nthe answer"
    assert calls == []
    assert not any("<" in piece.text or ">" in piece.text for piece in pieces)


def test_a_thought_that_ends_mid_delta() -> None:
    stream = ReplyStream(ChatInput(HELLO), None, MARKERS, thinking=True)
    pieces = stream.feed("still thinking</think>now the answer")
    assert pieces == [Piece("reasoning", "still thinking"), Piece("content", "now the answer")]
    assert stream.finish() == ([], [])


def test_a_partial_marker_is_held_then_given_back_as_what_it_was() -> None:
    stream = ReplyStream(ChatInput(HELLO), None, MARKERS, thinking=True)
    assert stream.feed("pondering </thi") == [Piece("reasoning", "pondering ")]
    assert stream.feed("s") == [Piece("reasoning", "</this")]  # not a marker after all
    assert stream.feed("</th") == []
    pieces, _ = stream.finish()  # the generation ended inside the thought
    assert pieces == [Piece("reasoning", "</th")]


def test_without_markers_everything_is_content() -> None:
    stream = ReplyStream(ChatInput(HELLO), None, None, thinking=True)
    text = "<think>not a thought</think> here"
    pieces, calls = fed(stream, [text[:9], text[9:]])
    assert joined(pieces, "content") == text and joined(pieces, "reasoning") == ""
    assert calls == []


def test_tools_after_a_thought(tokenizer: Any) -> None:
    chat = ChatInput(HELLO, tools=(WEATHER,))
    text = "which city?</think>\n\nLet me look." + CALL
    pieces, calls = fed(ReplyStream(chat, ToolFormat.of(tokenizer), MARKERS, True), list(text))
    assert joined(pieces, "reasoning") == "which city?"
    assert joined(pieces, "content") == "\n\nLet me look."
    [call] = calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}


def test_a_call_written_inside_a_thought_is_only_reasoning(tokenizer: Any) -> None:
    chat = ChatInput(HELLO, tools=(WEATHER,))
    stream = ReplyStream(chat, ToolFormat.of(tokenizer), MARKERS, True)
    pieces, calls = fed(stream, ["maybe " + CALL[:20], CALL[20:]])
    assert joined(pieces, "reasoning") == "maybe " + CALL and calls == []


@pytest.mark.parametrize("thinking", [True, False])
def test_streamed_at_any_cut_equals_read_whole(tokenizer: Any, thinking: bool) -> None:
    chat = ChatInput(HELLO, tools=(WEATHER,))
    found = ToolFormat.of(tokenizer)
    text = "a</think>b<think>c</think>d" + CALL
    whole = ReplyStream(chat, found, MARKERS, thinking).read_whole(text)
    for cut in range(len(text) + 1):
        pieces, calls = fed(ReplyStream(chat, found, MARKERS, thinking), [text[:cut], text[cut:]])
        assert (joined(pieces, "reasoning"), joined(pieces, "content")) == (
            whole.reasoning,
            whole.content,
        ), cut
        assert [(c.name, c.arguments) for c in calls] == [
            (c.name, c.arguments) for c in whole.calls
        ]
    # a thought may open again later; a close with none open is text
    expected = ("ac", "bd") if thinking else ("c", "a</think>bd")
    assert (whole.reasoning, whole.content) == expected


def test_the_stream_starts_where_the_prompt_left_off(tokenizer: Any) -> None:
    def starts_thinking(chat: ChatInput, **options: Any) -> bool:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hello"}], add_generation_prompt=True, **options
        )
        stream = ReplyStream.of(tokenizer, chat, None, prompt)
        return stream.feed("x") == [Piece("reasoning", "x")]

    assert starts_thinking(ChatInput(HELLO))  # the template opened a thought
    assert not starts_thinking(ChatInput(HELLO), enable_thinking=False)  # and closed it
    assert not starts_thinking(ChatInput(HELLO, thinking=False))
    assert not starts_thinking(ChatInput(HELLO, output_format=OutputFormat()))
    forced = ChatInput(HELLO, tools=(WEATHER,), tool_mode="required")
    assert not starts_thinking(forced)
