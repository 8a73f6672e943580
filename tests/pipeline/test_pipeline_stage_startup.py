"""Starting stages: each loads only its own layers; bad specs, models and layer ranges are
refused with the reason; strangers at the return port do not delay the chain."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from discovery.cluster_key import generate_key
from engines.pipeline.stage_model import StageModel
from engines.pipeline.stage_spec import StageSpec
from engines.pipeline.stage_worker import StageProcess
from errors import ConfigError, EngineError
from planner import allocate_layers
from tests.helpers.pipeline import HOST, Pipeline, make_engine, start_workers, stop_workers
from tests.helpers.strangers import open_strangers

pytestmark = pytest.mark.cluster

# -- loading and the worker contract -------------------------------------------------------------


def test_stages_load_only_their_own_layers(three_stages: Pipeline, five_layer_model: Path) -> None:
    config = json.loads((five_layer_model / "config.json").read_text())
    hidden, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    layer_bytes = 4 * (3 * hidden * hidden + 3 * hidden * inner)  # kv heads = heads / 2
    embedding_bytes = 4 * vocab * hidden
    middle, last = three_stages.workers  # layers [3, 4) and [4, 5) + norm + head
    assert layer_bytes <= middle.peak_memory_bytes < 1.2 * layer_bytes
    assert (
        layer_bytes + embedding_bytes
        <= last.peak_memory_bytes
        < 1.2 * (layer_bytes + embedding_bytes)
    )
    stage = StageModel.load(five_layer_model, range(3, 4), is_last=False)
    assert (stage.embed_tokens, stage.norm, stage.head, len(stage.blocks)) == (None, None, None, 1)


def test_unsupported_model_type_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "granite"}))
    with pytest.raises(EngineError, match="'granite'.*not supported.*scales embeddings"):
        StageModel.load(tmp_path, range(0, 1), is_last=False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layers": [2]}, "invalid field"),
        ({"cluster_key": "abcd"}, "32 bytes"),
        ({"cluster_key": "not a key"}, "neither"),
        ({"next_port": 0}, "invalid ports"),
        ({"layers": [3, 3]}, "empty"),
    ],
)
def test_stage_spec_rejects_bad_fields(change: dict[str, Any], message: str) -> None:
    spec = {
        "model_path": "/m",
        "layers": [0, 2],
        "is_last": False,
        "next_host": HOST,
        "next_port": 9,
        "cluster_key": "00" * 32,
    }
    assert StageSpec.from_json(json.dumps(spec)).layers == range(0, 2)
    with pytest.raises(ConfigError, match=message):
        StageSpec.from_json(json.dumps({**spec, **change}))
    missing = dict(spec)
    del missing["next_host"]
    with pytest.raises(ConfigError, match="next_host"):
        StageSpec.from_json(json.dumps(missing))


def test_worker_reports_failure_on_a_bad_layer_range(
    five_layer_model: Path, tmp_path: Path
) -> None:
    spec = {
        "model_path": str(five_layer_model),
        "layers": [3, 9],
        "is_last": True,
        "next_host": HOST,
        "next_port": 9,
        "cluster_key": generate_key().hex(),
    }
    with open(tmp_path / "stage.log", "ab") as log:
        with pytest.raises(EngineError, match=r"not inside the model's 5 layers"):
            StageProcess.start(spec, stderr=log, ready_timeout_s=60)


def test_strangers_at_the_return_port_do_not_delay_the_chain(
    five_layer_model: Path, cluster_key: bytes, tmp_path: Path
) -> None:
    """The coordinator's return port accepts the last stage while the chain forms: strangers
    already waiting there are proven off that path, and the chain forms as fast as alone."""
    ranges = allocate_layers(5, [1, 1, 1])
    listener, workers = start_workers(five_layer_model, ranges, cluster_key, tmp_path)
    strangers = open_strangers(listener.getsockname()[1], per_kind=8)
    engine = make_engine(five_layer_model, ranges, cluster_key, listener, workers)
    try:
        started = time.monotonic()
        engine.load()
        assert time.monotonic() - started < 5.0  # before: each stranger held it for seconds
        assert len(engine.info().detail["stages"]) == 3
    finally:
        for sock in strangers:
            sock.close()
        engine.close()
        stop_workers(workers)
