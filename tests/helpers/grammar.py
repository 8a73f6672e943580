"""What the grammar tests share: a small JSON schema, and how to tell a JSON object that
max_tokens cut short from free text."""

from __future__ import annotations

import json

REPLY_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "boolean"},
        "mood": {"enum": ["calm", "wild"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "mood", "count"],
    "additionalProperties": False,
}
# Endings that close a JSON object cut short inside a key, a value or after a comma.
CLOSINGS = ("", "}", '"}', '":0}', "0}", '":""}', 'n":0}', '\\n"}', '"]}', "]}", '0"}')


def completes_to_object(text: str) -> bool:
    """True when `text` is a JSON object, or one cut short that a few characters close."""
    for ending in CLOSINGS:
        try:
            return isinstance(json.loads(text + ending), dict)
        except ValueError:
            continue
    return False
