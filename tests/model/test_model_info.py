"""inspect_model: facts of real demo models and one-line ModelErrors for broken directories."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.models import llama

from engines.model.info import ModelFacts, inspect_model
from errors import ModelError

SMALL = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2}


@pytest.fixture
def model_copy(tmp_path: Path, demo_model_factory: Any) -> Path:
    """A private copy of a small demo model that a test may break."""
    return Path(shutil.copytree(demo_model_factory(**SMALL), tmp_path / "model"))


def edit_config(path: Path, **changes: Any) -> None:
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))


def test_facts_of_the_default_demo_model(demo_model_dir: Path) -> None:
    facts = inspect_model(demo_model_dir)
    assert (facts.model_type, facts.num_layers, facts.hidden_size) == ("llama", 4, 256)
    assert (facts.attention_heads, facts.kv_heads, facts.head_dim) == (8, 4, 32)
    assert (facts.vocab_size, facts.dtype_bytes, facts.tied_embeddings) == (1024, 4, False)
    assert facts.embedding_bytes == facts.head_bytes == 1024 * 256 * 4
    layer = (256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 512 + 2 * 256) * 4
    assert facts.weight_bytes == 2 * 1024 * 256 * 4 + 4 * layer + 256 * 4
    assert facts.weight_bytes < (demo_model_dir / "model.safetensors").stat().st_size
    assert facts.has_tp_variant is True
    assert facts.has_pipeline_variant == hasattr(llama.Model, "pipeline")


def test_tied_qwen3_has_no_head_bytes(demo_model_factory: Any) -> None:
    facts = inspect_model(demo_model_factory(arch="qwen3", **SMALL))
    assert facts.model_type == "qwen3" and facts.tied_embeddings
    assert facts.head_bytes == 0 and facts.embedding_bytes == 1024 * 64 * 4
    assert facts.has_tp_variant is True


def test_bfloat16_model_reports_two_byte_elements(demo_model_factory: Any) -> None:
    facts = inspect_model(demo_model_factory(**SMALL, dtype="bfloat16"))
    full = inspect_model(demo_model_factory(**SMALL))
    assert facts.dtype_bytes == 2
    assert facts.weight_bytes * 2 == full.weight_bytes


def test_odd_heads_model_facts(odd_heads_model_dir: Path) -> None:
    facts = inspect_model(str(odd_heads_model_dir))
    assert (facts.attention_heads, facts.kv_heads, facts.head_dim) == (3, 3, 32)
    assert facts.hidden_size == 96


def test_missing_optional_keys_fall_back_like_mlx_lm(model_copy: Path) -> None:
    config = json.loads((model_copy / "config.json").read_text())
    for key in ("num_key_value_heads", "head_dim", "tie_word_embeddings"):
        del config[key]
    (model_copy / "config.json").write_text(json.dumps(config))
    facts = inspect_model(model_copy)
    assert (facts.kv_heads, facts.head_dim) == (4, 16)
    assert facts.tied_embeddings is False  # lm_head.weight is in the files
    assert facts.head_bytes > 0


def test_unknown_architecture_is_a_model_error(model_copy: Path) -> None:
    edit_config(model_copy, model_type="no_such_arch")
    with pytest.raises(ModelError, match="mlx-lm cannot run this model"):
        inspect_model(model_copy)


def test_to_dict_is_json_ready(demo_model_dir: Path) -> None:
    facts = inspect_model(demo_model_dir)
    payload = json.loads(json.dumps(facts.to_dict()))
    assert payload["path"] == str(demo_model_dir)
    assert payload["num_layers"] == 4 and payload["has_tp_variant"] is True


def test_to_shape_feeds_the_planner(demo_model_dir: Path) -> None:
    planner = pytest.importorskip("planner")
    if not hasattr(planner, "ModelShape"):
        pytest.skip("planner.ModelShape is not there yet")
    facts = inspect_model(demo_model_dir)
    shape = facts.to_shape()
    assert isinstance(shape, planner.ModelShape)
    assert (shape.num_layers, shape.kv_heads, shape.weight_bytes) == (
        4,
        4,
        facts.weight_bytes,
    )
    assert shape.has_tp_variant is True


def break_nothing(path: Path) -> None:
    shutil.rmtree(path)


def remove_config(path: Path) -> None:
    (path / "config.json").unlink()


def corrupt_config(path: Path) -> None:
    (path / "config.json").write_text('{"model_type": "llama",')


def list_config(path: Path) -> None:
    (path / "config.json").write_text("[1, 2]")


def drop_layers(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    del config["num_hidden_layers"]
    (path / "config.json").write_text(json.dumps(config))


def zero_heads(path: Path) -> None:
    edit_config(path, num_attention_heads=0)


def text_layers(path: Path) -> None:
    edit_config(path, num_hidden_layers="four")


def remove_weights(path: Path) -> None:
    (path / "model.safetensors").unlink()


def truncate_weights(path: Path) -> None:
    (path / "model.safetensors").write_bytes(b"\x01\x02")


def garble_header(path: Path) -> None:
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{oops")


def oversize_header(path: Path) -> None:
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (break_nothing, "model directory does not exist"),
        (remove_config, "no config.json"),
        (corrupt_config, "cannot read config.json"),
        (list_config, "not a JSON object"),
        (drop_layers, "has no 'num_hidden_layers'"),
        (zero_heads, "'num_attention_heads' must be a positive int"),
        (text_layers, "'num_hidden_layers' must be a positive int"),
        (remove_weights, r"no model\*.safetensors weight files"),
        (truncate_weights, "truncated safetensors file"),
        (garble_header, "malformed safetensors header"),
        (oversize_header, "header length 1099511627776 is impossible"),
    ],
)
def test_broken_directories_raise_one_line_model_errors(
    model_copy: Path, damage: Any, message: str
) -> None:
    damage(model_copy)
    with pytest.raises(ModelError, match=message) as caught:
        inspect_model(model_copy)
    assert str(model_copy) in str(caught.value)
    assert "\n" not in str(caught.value)


def test_facts_are_frozen(demo_model_dir: Path) -> None:
    facts = inspect_model(demo_model_dir)
    assert isinstance(facts, ModelFacts)
    with pytest.raises(AttributeError):
        facts.num_layers = 1  # type: ignore[misc]
