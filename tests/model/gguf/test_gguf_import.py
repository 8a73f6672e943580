"""GGUF files into tandem's cache: the real SmolLM2 GGUF imported in seconds and answering, split
files, `--model FILE.gguf`, and bad input refused in one line with nothing left behind."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from mlx_lm import generate, load

from cli.main import main
from cli.model_source import resolve_model
from engines.model.gguf.cache import ensure_imported
from engines.model.gguf.importer import check_disk_room, import_gguf
from errors import ModelError
from tests.helpers.demo_models import make_demo_model
from tests.helpers.gguf_export import export_gguf
from tests.helpers.real_models import smollm2_gguf

T = GGMLQuantizationType
TINY = {"arch": "llama", "layers": 2, "heads": 4, "kv_heads": 2, "hidden": 64}
IMPORT_CPU_S = 10.0  # issue 38's target for the 92 MB SmolLM2 GGUF on this machine
CACHED_CPU_S = 1.0  # serving from the cache again: no hashing, no import


@pytest.fixture(scope="module")
def tiny_gguf(gguf_root: Path) -> Path:
    """A tiny llama demo model as a Q8_0 GGUF."""
    folder = gguf_root / "import"
    folder.mkdir(exist_ok=True)
    path = folder / "tiny.gguf"
    if not path.exists():
        export_gguf(make_demo_model(gguf_root / "demo", **TINY), path, T.Q8_0)
    return path


def test_smollm2_imports_in_seconds_and_answers(tmp_path: Path) -> None:
    source = smollm2_gguf()
    started = time.process_time()
    directory = ensure_imported(source, tmp_path)
    import_cpu_s = time.process_time() - started
    assert import_cpu_s <= IMPORT_CPU_S
    config = json.loads((directory / "config.json").read_text())
    assert directory.name == "SmolLM2-135M-Instruct.Q4_1"
    assert (config["model_type"], config["num_hidden_layers"]) == ("llama", 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True
    quantization = config["quantization"]
    assert (quantization["bits"], quantization["group_size"]) == (4, 32)  # Q4_1 blocks
    assert quantization["model.embed_tokens"]["bits"] == 8  # its Q8_0 embedding
    # Q4_1 and Q8_0 stay as mx.load reads them: the same codes, the same scales (widened).
    native = mx.load(str(source))
    imported = mx.load(str(directory / "model.safetensors"))
    for gguf_name, name in (
        ("blk.3.attn_v", "model.layers.3.self_attn.v_proj"),
        ("blk.7.ffn_down", "model.layers.7.mlp.down_proj"),
        ("token_embd", "model.embed_tokens"),
    ):
        assert mx.array_equal(native[f"{gguf_name}.weight"], imported[f"{name}.weight"])
        for part in ("scales", "biases"):
            widened = native[f"{gguf_name}.{part}"].astype(mx.float32)
            assert mx.array_equal(widened, imported[f"{name}.{part}"].astype(mx.float32))
    started = time.process_time()
    assert ensure_imported(source, tmp_path) == directory
    assert time.process_time() - started < CACHED_CPU_S
    model, tokenizer = load(str(directory))
    answer = generate(model, tokenizer, "The capital of France is", max_tokens=4)
    assert "Paris" in answer


def test_a_split_gguf_imports_as_the_whole_file(gguf_root: Path, tmp_path: Path) -> None:
    demo = make_demo_model(gguf_root / "demo", **TINY)
    export_gguf(demo, tmp_path / "whole.gguf", T.Q8_0)
    export_gguf(demo, tmp_path / "split.gguf", T.Q8_0, split_max_tensors=8)
    parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(parts) > 2
    whole = import_gguf(tmp_path / "whole.gguf", tmp_path / "whole")
    split = ensure_imported(parts[1], tmp_path / "cache")  # any part names the whole set
    assert split.name == "split"
    expected = mx.load(str(whole / "model.safetensors"))
    found = mx.load(str(split / "model.safetensors"))
    assert sorted(found) == sorted(expected)
    assert all(mx.array_equal(found[name], expected[name]) for name in expected)


def test_model_flag_serves_the_import_of_a_gguf(tiny_gguf: Path, tmp_path: Path) -> None:
    facts = resolve_model(str(tiny_gguf), tmp_path)
    assert facts.path.parent.parent == tmp_path / "gguf"
    assert facts.path.name == "tiny"  # clients see the file's name as the model id
    assert (facts.model_type, facts.num_layers, facts.quantized) == ("llama", 2, True)
    assert resolve_model(str(tiny_gguf), tmp_path).path == facts.path


def _bad_inputs(tiny: Path, folder: Path) -> dict[str, tuple[Path, str]]:
    """Each bad input: the file, and what its one-line error must say."""
    data = tiny.read_bytes()
    (folder / "magic.gguf").write_bytes(b"GGML" + data[4:])
    (folder / "truncated.gguf").write_bytes(data[: len(data) * 2 // 3])
    demo = make_demo_model(tiny.parent.parent / "demo", **TINY)
    export_gguf(demo, folder / "falcon.gguf", T.Q8_0, architecture_name="falcon")
    # Fails last, in the tokenizer, after every weight is written.
    export_gguf(demo, folder / "late.gguf", T.Q8_0, pre_tokenizer="no-such-pre-tokenizer")
    return {
        "magic": (folder / "magic.gguf", "not a GGUF file"),
        "truncated": (folder / "truncated.gguf", "truncated or corrupt GGUF"),
        "architecture": (folder / "falcon.gguf", "architecture 'falcon' is not supported"),
        "missing": (folder / "missing.gguf", "no such GGUF file"),
        "late": (folder / "late.gguf", "no-such-pre-tokenizer"),
    }


def test_bad_input_is_one_line_and_leaves_nothing(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    for name, (path, expected) in _bad_inputs(tiny_gguf, tmp_path).items():
        for out in ([], [str(tmp_path / f"out-{name}")]):
            code = main(
                ["--log-level", "ERROR", "import", str(path), *out, "--cache-dir", str(cache)]
            )
            lines = capsys.readouterr().err.strip().splitlines()
            assert code == 1, name
            assert len(lines) == 1 and lines[0].startswith("tandem: error: "), (name, lines)
            assert expected in lines[0], (name, lines[0])
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith((".", "out-"))]
    assert left == []
    models = [p for p in (cache / "gguf").iterdir() if p.name != "digests.json"]
    assert models == []


def test_a_disk_without_room_is_refused(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ModelError, match="not enough disk space"):
        check_disk_room(tmp_path, free)
    check_disk_room(tmp_path, 1)
    assert np.isfinite(free)
