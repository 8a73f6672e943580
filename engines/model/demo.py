"""Deterministic random-weight demo models (llama, qwen3 and more mlx-lm families, optionally
quantized) with a real trained BPE tokenizer: their configs, built in a hidden directory and
published whole. What to build is a DemoSpec (demo_spec.py); the tokenizer, the weights and
the safetensors bytes come from demo_tokenizer.py, demo_weights.py and demo_architectures.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from discovery.directories import default_cache_dir
from engines.model.demo_architectures import CONFIG_EXTRAS, make_weights
from engines.model.demo_spec import ARCHITECTURES, DEFAULT_SPEC, DemoSpec
from engines.model.demo_tokenizer import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    THINKING_CHAT_TEMPLATE,
    _count_token_ids,
    _silent_ids,
    _train_tokenizer,
    _with_think_tokens,
)
from engines.model.demo_weights import GAINS, _make_weights, _write_safetensors
from errors import ConfigError

log = logging.getLogger(__name__)

DEMO_BUILD_STEPS = 4  # the progress callback's calls: tokenizer, config, weights, safetensors
MAX_POSITIONS = 4096
HAND_WRITTEN = frozenset({"llama", "qwen3"})
QUANTIZE_GROUP_SIZE = 32  # divides every demo dimension (hidden and heads x head_dim >= 32)
ROPE_THETA = {"llama": 10000.0, "qwen3": 1000000.0}
RMS_NORM_EPS = {"llama": 1e-5, "qwen3": 1e-6}


def default_demo_path(cache_dir: Path | None = None, spec: DemoSpec = DEFAULT_SPEC) -> Path:
    """Where the demo model for `spec` lives under `cache_dir` (default ~/.cache/tandem).

    The CLI passes $XDG_CACHE_HOME/tandem when that is set; nothing here reads the environment.
    """
    root = cache_dir if cache_dir is not None else default_cache_dir()
    quantized = f"-q{spec.quantize}" if spec.quantize else ""
    return root / f"demo-{spec.arch}{quantized}-{spec.digest()}"


def ensure_demo_model(
    cache_dir: Path | None = None,
    spec: DemoSpec = DEFAULT_SPEC,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Return the cached demo model for `spec`, building it first if it is not there yet.

    `progress`, when given, is called after each of the DEMO_BUILD_STEPS build steps.
    """
    path = default_demo_path(cache_dir, spec)
    if (path / "config.json").is_file():
        return path
    log.info("building demo model %s at %s", spec, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = _build_staging(path, spec, progress)
    try:
        os.rename(staging, path)
    except OSError:
        # Another process published the same model first: theirs is identical, use it.
        shutil.rmtree(staging, ignore_errors=True)
        if not (path / "config.json").is_file():
            raise
    return path


def write_demo_model(
    path: Path,
    spec: DemoSpec = DEFAULT_SPEC,
    *,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write the demo model for `spec` into `path` atomically and return `path`.

    The files are built in a hidden directory next to `path` and renamed into place, so a
    crash never leaves a half-written model that looks valid. An existing empty directory
    is replaced; a non-empty one only with `overwrite`.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ConfigError(f"{path} already exists and is not empty; pass overwrite to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = _build_staging(path, spec, progress)
    retired = None
    if path.is_dir():
        retired = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old-"))
        os.rename(path, retired / "model")
    os.rename(staging, path)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)
    return path


def _build_staging(
    path: Path, spec: DemoSpec, progress: Callable[[str], None] | None = None
) -> Path:
    """Build every file of the model in a fresh hidden directory beside `path`."""
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.partial-"))
    advance = progress or (lambda step: None)
    try:
        tokenizer_json = _train_tokenizer(spec.vocab)
        if spec.thinking:
            tokenizer_json = _with_think_tokens(tokenizer_json)
        vocab_size = _count_token_ids(tokenizer_json)
        advance("tokenizer")
        _write_text(staging / "tokenizer.json", tokenizer_json)
        _write_text(staging / "tokenizer_config.json", _dump(_tokenizer_config(spec)))
        config = _model_config(spec, vocab_size)
        _write_text(staging / "config.json", _dump(config))
        _write_text(staging / "demo_spec.json", _dump(dataclasses.asdict(spec)))
        advance("config")
        silent = _silent_ids(tokenizer_json)
        if spec.arch in HAND_WRITTEN:
            weights = _make_weights(spec, vocab_size, silent)
        else:
            weights = make_weights(config, spec.tie_embeddings, silent, spec.seed, GAINS)
        advance("weights")
        _write_safetensors(staging / "model.safetensors", weights, spec)
        advance("safetensors")
        if spec.quantize:
            staging = _quantize(staging, path, spec)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def _quantize(staging: Path, path: Path, spec: DemoSpec) -> Path:
    """Quantize the float model in `staging` with mlx-lm's converter; returns the new staging.

    The converter writes weights, config (with its quantization entry) and tokenizer files;
    the demo spec is copied over.
    """
    from mlx_lm.convert import convert

    quantized = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.partial-")) / "q"
    try:
        convert(
            str(staging),
            mlx_path=str(quantized),
            quantize=True,
            q_bits=spec.quantize,
            q_group_size=QUANTIZE_GROUP_SIZE,
        )
        shutil.copyfile(staging / "demo_spec.json", quantized / "demo_spec.json")
    except BaseException:
        shutil.rmtree(quantized.parent, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    # Publish the converter's directory itself: move it up out of its temporary parent.
    final = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.partial-"))
    os.rmdir(final)
    os.rename(quantized, final)
    shutil.rmtree(quantized.parent, ignore_errors=True)
    return final


def _tokenizer_config(spec: DemoSpec) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": THINKING_CHAT_TEMPLATE if spec.thinking else CHAT_TEMPLATE,
    }


def _model_config(spec: DemoSpec, vocab_size: int) -> dict:
    config = {
        "model_type": spec.arch,
        "architectures": [ARCHITECTURES[spec.arch]],
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": RMS_NORM_EPS.get(spec.arch, 1e-5),
        "rope_theta": ROPE_THETA.get(spec.arch, 10000.0),
        "tie_word_embeddings": spec.tie_embeddings,
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
        "torch_dtype": spec.dtype,
    }
    if spec.arch in CONFIG_EXTRAS:
        config.update(CONFIG_EXTRAS[spec.arch](spec))
    return config


def _dump(value: dict) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
