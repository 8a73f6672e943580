"""EngineOptions: one checked value whose document round-trips across process boundaries."""

from __future__ import annotations

import json

import pytest

from engines.core.engine_options import EngineOptions
from errors import ConfigError


def test_the_document_round_trips_through_json():
    options = EngineOptions(
        max_batch=3, kv_bits=4, quantized_kv_start=0, most_drafted=5,
        prefix_cache_dir="/cache/prefix-cache", draft_model_path="/models/draft", upcast=True,
    )  # fmt: skip
    assert EngineOptions.from_document(json.loads(json.dumps(options.document()))) == options


def test_every_field_crosses_in_the_document():
    document = EngineOptions().document()
    assert set(document) == set(EngineOptions.__slots__)
    assert EngineOptions.from_document({}) == EngineOptions()  # a field left out: its default


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"kv_bit": 8}, r"unknown engine options: \['kv_bit'\]"),
        ({"kv_bits": 3}, r"kv_bits must be 0 or one of \(4, 8\), got 3"),
        ({"max_batch": 0}, "max_batch and prefill_chunk must be at least 1, got 0 and 256"),
        ({"quantized_kv_start": -1}, "quantized_kv_start must be 0 or more, got -1"),
        ({"max_batch": "4"}, "engine option max_batch must be int, got '4'"),
        ({"upcast": 1}, "engine option upcast must be bool, got 1"),
        ({"prefix_cache_bytes": True}, "engine option prefix_cache_bytes must be int, got True"),
        ([], r"engine options must be a JSON object, got \[\]"),
    ],
)
def test_an_invalid_document_is_refused_naming_the_field(document, message):
    with pytest.raises(ConfigError, match=message):
        EngineOptions.from_document(document)
