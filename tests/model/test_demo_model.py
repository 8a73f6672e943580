"""Demo models: mlx-lm loads them, generation is deterministic and varied, files reproduce."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.sample_utils import make_sampler

import engines.model.demo as demo_model
from engines.model.demo import default_demo_path, ensure_demo_model, write_demo_model
from engines.model.demo_spec import DemoSpec
from engines.model.demo_tokenizer import EOS_TOKEN, PRINTABLE, SPECIAL_TOKENS
from errors import ConfigError

SMALL = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2}
GREEDY = make_sampler(0.0)
PROMPTS = ("The keeper climbed the tower", "Once upon a time", "Bread asks for very little")


@pytest.fixture(scope="module")
def loaded(demo_model_dir: Path) -> tuple[Any, Any]:
    return mlx_lm.load(str(demo_model_dir))


def greedy_tokens(model: Any, tokenizer: Any, prompt: str | list[int], count: int) -> list[int]:
    responses = mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=count, sampler=GREEDY)
    return [response.token for response in responses]


def file_digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_generation_runs_to_max_tokens_and_repeats_across_loads(
    demo_model_dir: Path, loaded: tuple[Any, Any]
) -> None:
    first = greedy_tokens(*loaded, PROMPTS[0], 24)
    second = greedy_tokens(*mlx_lm.load(str(demo_model_dir)), PROMPTS[0], 24)
    assert len(first) == 24  # special tokens (EOS included) are never the greedy pick
    assert first == second
    assert not set(first) & set(range(len(SPECIAL_TOKENS)))


def test_different_prompts_give_different_varied_outputs(loaded: tuple[Any, Any]) -> None:
    outputs = [tuple(greedy_tokens(*loaded, prompt, 24)) for prompt in PROMPTS]
    assert len(set(outputs)) == len(PROMPTS)
    for output in outputs:
        assert len(set(output)) > 8, output  # no collapse onto one repeated token


def test_output_text_is_printable(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    text = mlx_lm.generate(model, tokenizer, PROMPTS[1], max_tokens=32, sampler=GREEDY)
    assert text and set(text) <= PRINTABLE


def test_chat_template_renders_turns_and_generation_prompt(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why is the sky blue?"},
    ]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert tokenizer.decode(ids) == (
        "<|begin|><|system|>\nBe brief.<|end|>\n"
        "<|user|>\nWhy is the sky blue?<|end|>\n<|assistant|>\n"
    )
    assert ids[0] == tokenizer.bos_token_id
    assert ids[-2] == SPECIAL_TOKENS.index("<|assistant|>")  # one token, not spelled out
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not plain.endswith("<|assistant|>\n")


def test_chat_template_refuses_unknown_role(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    with pytest.raises(Exception, match="unsupported chat role: robot"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_tokenizer_round_trips_text_and_knows_its_eos(
    demo_model_dir: Path, loaded: tuple[Any, Any]
) -> None:
    _, tokenizer = loaded
    config = json.loads((demo_model_dir / "config.json").read_text())
    text = "The river flooded in March.\n  Café, naïve — 42 ☃ tokens!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode("the lighthouse keeper", add_special_tokens=False)) < 8
    assert len(tokenizer.vocab) == config["vocab_size"] == 1024
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.eos_token_ids == {config["eos_token_id"]}


def test_same_spec_gives_byte_identical_files_and_seed_changes_weights(tmp_path: Path) -> None:
    first = write_demo_model(tmp_path / "a", DemoSpec(**SMALL))
    second = write_demo_model(tmp_path / "b", DemoSpec(**SMALL))
    reseeded = write_demo_model(tmp_path / "c", DemoSpec(**SMALL, seed=1))
    assert file_digests(first) == file_digests(second)
    assert file_digests(first)["tokenizer.json"] == file_digests(reseeded)["tokenizer.json"]
    assert file_digests(first)["model.safetensors"] != file_digests(reseeded)["model.safetensors"]


def test_tokenizer_training_is_identical_in_a_fresh_process(demo_model_dir: Path) -> None:
    script = (
        "import sys; from engines.model.demo_tokenizer import _train_tokenizer as t; print(t(1024))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123", "RAYON_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        check=True,
    )
    assert result.stdout.rstrip("\n") == (demo_model_dir / "tokenizer.json").read_text()


def test_qwen3_loads_tied_and_generates(demo_model_factory: Any) -> None:
    path = demo_model_factory(arch="qwen3", **SMALL)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["tie_word_embeddings"] is True
    assert config["head_dim"] == 16
    model, tokenizer = mlx_lm.load(str(path))
    tokens = greedy_tokens(model, tokenizer, PROMPTS[0], 16)
    assert len(tokens) == 16 and len(set(tokens)) > 1


def test_bfloat16_weights_are_the_rounded_float32_weights(demo_model_factory: Any) -> None:
    full = mx.load(str(demo_model_factory(**SMALL) / "model.safetensors"))
    half = mx.load(str(demo_model_factory(**SMALL, dtype="bfloat16") / "model.safetensors"))
    assert full.keys() == half.keys()
    for name, weight in half.items():
        assert weight.dtype == mx.bfloat16
        assert mx.array_equal(weight, full[name].astype(mx.bfloat16)), name


def test_crashed_write_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(demo_model, "_write_safetensors", fail)
    with pytest.raises(OSError, match="disk full"):
        write_demo_model(tmp_path / "model", DemoSpec(**SMALL))
    assert list(tmp_path.iterdir()) == []


def test_write_refuses_a_non_empty_directory_unless_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not empty"):
        write_demo_model(target, DemoSpec(**SMALL))
    write_demo_model(target, DemoSpec(**SMALL), overwrite=True)
    assert not (target / "notes.txt").exists() and (target / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_ensure_builds_once_under_a_spec_specific_name(tmp_path: Path) -> None:
    spec = DemoSpec(**SMALL)
    path = ensure_demo_model(tmp_path, spec)
    assert path == default_demo_path(tmp_path, spec)
    assert path.name.startswith("demo-llama-")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(tmp_path, spec) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert default_demo_path(tmp_path, DemoSpec(**SMALL, seed=1)) != path
    assert default_demo_path(None, spec).parent == Path.home() / ".cache" / "tandem"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"arch": "gpt2"}, "demo arch 'gpt2'"),
        ({"dtype": "int8"}, "demo dtype 'int8'"),
        ({"layers": 0}, "layers must be >= 1"),
        ({"heads": 6, "kv_heads": 4, "hidden": 96}, r"heads \(6\) must be a multiple of kv_heads"),
        ({"heads": 3, "kv_heads": 3, "hidden": 256}, r"hidden \(256\) must be a multiple of heads"),
        ({"heads": 4, "kv_heads": 4, "hidden": 12}, "head_dim must be even"),
        ({"head_dim": 0}, "head_dim must be >= 1"),
        ({"intermediate": 0}, "intermediate must be >= 1"),
        ({"vocab": 100}, "vocab must be in"),
    ],
)
def test_spec_rejects_impossible_models(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DemoSpec(**overrides)


def test_spec_derives_hidden_from_heads_unless_given() -> None:
    default, odd = DemoSpec(), DemoSpec(heads=3, kv_heads=3)
    assert (default.hidden_size, default.head_size, default.intermediate_size) == (256, 32, 512)
    assert (odd.hidden_size, odd.head_size) == (96, 32)
    assert DemoSpec(hidden=64, heads=4).head_size == 16
    assert DemoSpec(heads=2, kv_heads=2, head_dim=8).hidden_size == 16


def test_odd_heads_model_is_not_divisible_by_two(odd_heads_model_dir: Path) -> None:
    config = json.loads((odd_heads_model_dir / "config.json").read_text())
    assert config["num_attention_heads"] % 2 == 1
    assert config["num_key_value_heads"] % 2 == 1
    model, tokenizer = mlx_lm.load(str(odd_heads_model_dir))
    assert len(greedy_tokens(model, tokenizer, PROMPTS[2], 8)) == 8


@pytest.mark.parametrize("arch", ["gemma3_text", "deepseek_v3"])
def test_mlx_lm_architectures_are_byte_identical_and_load(arch: str, tmp_path: Path) -> None:
    first = write_demo_model(tmp_path / "a", DemoSpec(arch=arch, **SMALL))
    second = write_demo_model(tmp_path / "b", DemoSpec(arch=arch, **SMALL))
    assert file_digests(first) == file_digests(second)
    model, tokenizer = mlx_lm.load(str(first))
    assert type(model).__module__ == f"mlx_lm.models.{arch}"
    assert len(set(greedy_tokens(model, tokenizer, PROMPTS[0], 16))) >= 4  # not stuck


def test_quantized_demo_model_keeps_its_tokenizer_and_chat_template(tmp_path: Path) -> None:
    path = ensure_demo_model(tmp_path, DemoSpec(arch="qwen3_moe", quantize=4, **SMALL))
    assert path.name.startswith("demo-qwen3_moe-q4-")
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    assert json.loads((path / "demo_spec.json").read_text())["quantize"] == 4
    model, tokenizer = mlx_lm.load(str(path))
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|assistant|>\n")
    assert len(greedy_tokens(model, tokenizer, PROMPTS[1], 8)) == 8


def test_unquantized_specs_keep_their_digest() -> None:
    # quantize was added later; specs without it hash as before (cached models stay valid).
    assert "quantize" not in json.dumps(DemoSpec().digest())
    assert DemoSpec(quantize=None).digest() == DemoSpec().digest() != DemoSpec(quantize=8).digest()
