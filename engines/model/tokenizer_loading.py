"""A model directory's tokenizer as every engine serves it: mlx-lm's wrapper, with the EOS
ids of the model's config (what mlx_lm.load gives the single engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_lm.utils import load_config, load_tokenizer


def load_serving_tokenizer(model_path: Path | str, chat_template: str | None = None) -> Any:
    """OSError or ValueError when the directory has no usable config or tokenizer.

    `chat_template` (`serve --chat-template`): the Jinja template to render chats with, in
    place of the model's own (or of none); mlx-lm reads its tool-call format from it as from
    a template the model ships."""
    config = load_config(Path(model_path))
    extra = {"chat_template": chat_template} if chat_template is not None else None
    return load_tokenizer(
        Path(model_path), tokenizer_config_extra=extra, eos_token_ids=config.get("eos_token_id")
    )
