"""Tiny deterministic demo models for tests, written once under a directory and reused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from engines.model.demo import ensure_demo_model
from engines.model.demo_spec import DemoSpec
from engines.model.gguf.cache import ensure_imported
from tests.helpers.gguf_export import export_gguf

# A chat template for the base model (no model ships it), and what it renders for one
# "Hello there" from the user: recognisable in a prompt's tokens.
BASE_CHAT_TEMPLATE = (
    "{% for message in messages %}### {{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}### assistant:{% endif %}"
)
BASE_CHAT_RENDERED = "### user: Hello there\n### assistant:"


def make_demo_model(tmp_path: Path, **overrides: Any) -> Path:
    """A demo model for DemoSpec(**overrides) under `tmp_path`, reused if already there."""
    return ensure_demo_model(Path(tmp_path), DemoSpec(**overrides))


def make_base_model(demo_dir: Path, root: Path) -> Path:
    """`demo_dir` as a base model: a Q8_0 GGUF with no tokenizer.chat_template, imported
    under `root` as `tandem serve --model FILE.gguf` imports one."""
    path = root / "base.gguf"
    export_gguf(demo_dir, path, GGMLQuantizationType.Q8_0, chat_template=False)
    return ensure_imported(path, root / "cache")
