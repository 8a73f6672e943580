"""A model directory's tokenizer as every engine serves it: mlx-lm's wrapper, with the EOS
ids of the model's config (what mlx_lm.load gives the single engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_lm.utils import load_config, load_tokenizer


def load_serving_tokenizer(model_path: Path | str) -> Any:
    """OSError or ValueError when the directory has no usable config or tokenizer."""
    config = load_config(Path(model_path))
    return load_tokenizer(Path(model_path), eos_token_ids=config.get("eos_token_id"))
