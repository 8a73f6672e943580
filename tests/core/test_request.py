"""GenerationRequest: its one check, table by table, and its one serialisation."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from engines.core.request import (
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_TOKENS,
    MAX_TOP_LOGPROBS,
    GenerationRequest,
)
from errors import RequestError

FULL = GenerationRequest(
    "r-1",
    (5, 6, 7),
    99,
    temperature=0.7,
    top_p=0.95,
    top_k=40,
    min_p=0.05,
    stop=("\u00e9", "."),
    seed=MAX_SEED,
    timeout_s=12.5,
    repetition_penalty=1.3,
    presence_penalty=-0.25,
    frequency_penalty=2.0,
    logprobs=MAX_TOP_LOGPROBS,
    grammar='{"type": "object"}',
)

REFUSED: list[tuple[str, Any, str]] = [
    ("request_id", "", "request_id must be a text of 1 to 128 characters, got ''"),
    ("request_id", "x" * 129, "request_id must be a text of 1 to 128 characters"),
    ("prompt_tokens", (), "prompt_tokens must be a non-empty tuple of token ids"),
    ("prompt_tokens", [1], "prompt_tokens must be a non-empty tuple"),
    ("prompt_tokens", (1, -1), "got (1, -1)"),
    ("prompt_tokens", (True,), "prompt_tokens must be"),
    ("max_tokens", 0, f"max_tokens must be an integer in [1, {MAX_TOKENS}], got 0"),
    ("max_tokens", 1.0, "max_tokens must be an integer"),
    ("temperature", 2.5, "temperature must be a number in [0, 2], got 2.5"),
    ("temperature", -0.1, "temperature must be a number in [0, 2], got -0.1"),
    ("temperature", float("nan"), "got nan"),
    ("temperature", "hot", "got 'hot'"),
    ("top_p", 0, "top_p must be a number in (0, 1], got 0"),
    ("top_p", 1.5, "top_p must be a number in (0, 1], got 1.5"),
    ("top_k", -1, "top_k must be an integer in [0, 2147483647], got -1"),
    ("top_k", 2.0, "top_k must be an integer"),
    ("min_p", 1.5, "min_p must be a number in [0, 1], got 1.5"),
    ("stop", ("a",) * 5, "stop must be a tuple of at most 4 texts"),
    ("stop", ("a" * (MAX_STOP_CHARS + 1),), "of at most 256 characters each"),
    ("stop", "a", "stop must be a tuple"),
    ("seed", -1, f"seed must be null or an integer in [0, {MAX_SEED}], got -1"),
    ("seed", MAX_SEED + 1, f"got {MAX_SEED + 1}"),
    ("seed", True, "got True"),
    ("timeout_s", 0, "timeout_s must be a positive number of seconds, got 0"),
    ("timeout_s", float("inf"), "got inf"),
    ("repetition_penalty", 0.0, "repetition_penalty must be null or a number in [0.01, 10]"),
    ("repetition_penalty", MAX_REPETITION_PENALTY + 1, "got 11.0"),
    ("presence_penalty", 2.5, "presence_penalty must be a number in [-2, 2], got 2.5"),
    ("frequency_penalty", -3, "frequency_penalty must be a number in [-2, 2], got -3"),
    ("logprobs", MAX_TOP_LOGPROBS + 1, "logprobs must be null or an integer in [0, 20], got 21"),
    ("logprobs", -1, "got -1"),
    ("grammar", "", "grammar must be null or a non-empty text, got ''"),
    ("grammar", 5, "got 5"),
]


@pytest.mark.parametrize(("field", "value", "message"), REFUSED)
def test_check_names_the_field_and_its_value(field: str, value: Any, message: str) -> None:
    with pytest.raises(RequestError) as refused:
        replace(FULL, **{field: value}).check()
    assert refused.value.field == field
    assert message in str(refused.value)


def test_the_limits_themselves_pass() -> None:
    assert FULL.check() is FULL
    assert GenerationRequest("r", (0,), 1).check()  # every default passes
    edges = {"temperature": 2, "top_p": 1, "seed": 0, "repetition_penalty": 0.01, "logprobs": 0}
    replace(FULL, **edges).check()


def test_a_long_value_is_cut_short_in_the_message() -> None:
    with pytest.raises(RequestError, match=r"got 'xxxx.*\.\.\.$"):
        replace(FULL, request_id="x" * 1000).check()


def test_the_document_round_trips_through_json_exactly() -> None:
    document = json.loads(json.dumps(FULL.document()))
    assert GenerationRequest.from_document(document) == FULL
    minimal = GenerationRequest("r", (1,), 2)
    assert GenerationRequest.from_document(minimal.document()) == minimal


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (None, "request must be a JSON object, got None"),
        ([], "request must be a JSON object"),
        ({**FULL.document(), "typ_p": 5}, "typ_p must be absent (not a request field), got 5"),
        ({"prompt_tokens": [1], "max_tokens": 1}, "request_id must be present"),
        ({**FULL.document(), "temperature": 3}, "temperature must be a number in [0, 2], got 3"),
        ({**FULL.document(), "prompt_tokens": [[1]]}, "prompt_tokens must be"),
    ],
)
def test_from_document_checks_what_it_decodes(document: Any, message: str) -> None:
    with pytest.raises(RequestError) as refused:
        GenerationRequest.from_document(document)
    assert message in str(refused.value)
