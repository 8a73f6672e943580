"""The thinking demo model: two think markers after the default vocabulary (every other id the
same), a template that thinks unless told not to, and markers the model never writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx_lm
import pytest
from mlx_lm.sample_utils import make_sampler

from engines.model.demo_spec import DemoSpec
from engines.model.demo_tokenizer import THINK_END, THINK_START

GREEDY = make_sampler(temp=0.0)
ROOT = Path(__file__).resolve().parents[2]
TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello.", "reasoning_content": "A greeting."},
    {"role": "user", "content": "Why?"},
]


@pytest.fixture(scope="module")
def loaded(thinking_model_dir: Path) -> tuple[Any, Any]:
    return mlx_lm.load(str(thinking_model_dir))


def vocabulary(path: Path) -> dict[str, int]:
    content = json.loads((path / "tokenizer.json").read_text())
    added = {token["content"]: token["id"] for token in content["added_tokens"]}
    return {**content["model"]["vocab"], **added}


def test_the_markers_come_after_every_default_id(
    demo_model_dir: Path, thinking_model_dir: Path
) -> None:
    default, thinking = vocabulary(demo_model_dir), vocabulary(thinking_model_dir)
    size = len(default)
    assert thinking == {**default, THINK_START: size, THINK_END: size + 1}
    assert json.loads((thinking_model_dir / "config.json").read_text())["vocab_size"] == size + 2
    assert (
        DemoSpec(thinking=False).digest() == DemoSpec().digest() != DemoSpec(thinking=True).digest()
    )


def test_the_template_thinks_unless_told_not_to(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    assert tokenizer.has_thinking and tokenizer.think_end == THINK_END

    def prompt(**options: bool) -> str:
        return tokenizer.apply_chat_template(
            TURNS, add_generation_prompt=True, tokenize=False, **options
        )

    passed_back = "<|assistant|>\n<think>\nA greeting.\n</think>\n\nHello.<|end|>\n"
    assert passed_back in prompt()
    assert prompt().endswith("<|user|>\nWhy?<|end|>\n<|assistant|>\n<think>\n")
    assert prompt(enable_thinking=True) == prompt()
    assert prompt(enable_thinking=False).endswith("<|assistant|>\n<think>\n\n</think>\n\n")
    ids = tokenizer.apply_chat_template(TURNS, add_generation_prompt=True)
    assert ids[-2] == tokenizer.think_start_id  # one token, not spelled out


def test_the_model_never_writes_a_marker(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    for options in ({}, {"enable_thinking": False}):
        prompt = tokenizer.apply_chat_template(TURNS, add_generation_prompt=True, **options)
        text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=48, sampler=GREEDY)
        assert len(tokenizer.encode(text, add_special_tokens=False)) >= 40
        assert THINK_START not in text and THINK_END not in text


def test_the_cli_writes_one(tmp_path: Path) -> None:
    path = tmp_path / "model"
    command = [sys.executable, "-m", "cli.main", "demo-model", str(path), "--layers", "1"]
    result = subprocess.run(
        [*command, "--thinking"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "thinking demo model" in result.stdout
    assert THINK_END in vocabulary(path)
