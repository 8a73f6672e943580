"""Stored responses: a bounded, least-recently-used memory of finished responses, so that
`previous_response_id` continues a conversation and GET / DELETE find them."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from engines.api.conversation import ToolCall, Turn
from engines.api.responses.objects import (
    FunctionCallOutput,
    MessageOutput,
    ReasoningOutput,
    Response,
)

# Enough for a few agents' recent turns; a response is its text, so this stays small in memory.
MAX_STORED_RESPONSES = 256


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: Response
    conversation: tuple[Turn, ...]  # its input turns (no instructions) and its reply


def reply_turn(response: Response) -> Turn:
    """The assistant turn a response's output items make, for the next request to continue."""
    reasoning = "".join(
        part.text
        for item in response.output
        if isinstance(item, ReasoningOutput)
        for part in item.content
    )
    content = "".join(
        part.text
        for item in response.output
        if isinstance(item, MessageOutput)
        for part in item.content
    )
    calls = tuple(
        ToolCall(item.call_id, item.name, item.arguments)
        for item in response.output
        if isinstance(item, FunctionCallOutput)
    )
    return Turn("assistant", content, tool_calls=calls, reasoning=reasoning or None)


class ResponseStore:
    """At most `capacity` responses; storing one more forgets the least recently used."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: Response, conversation: tuple[Turn, ...]) -> None:
        entry = StoredResponse(response, (*conversation, reply_turn(response)))
        with self._lock:
            self._entries[response.id] = entry
            self._entries.move_to_end(response.id)
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)
