"""Deterministic random-weight demo models (llama, qwen3 and more mlx-lm families, optionally
quantized) with a real trained BPE tokenizer."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import string
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from discovery.directories import default_cache_dir
from engines.model.demo_architectures import (
    ARCHITECTURE_NAMES,
    CONFIG_EXTRAS,
    TIED_BY_DEFAULT,
    make_weights,
)
from planner.errors import ConfigError

log = logging.getLogger(__name__)

# Bump when the bytes written for a given spec change, so cached demo models are rebuilt.
GENERATOR_VERSION = 2
DEMO_BUILD_STEPS = 4  # the progress callback's calls: tokenizer, config, weights, safetensors
CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"

BOS_TOKEN = "<|begin|>"
EOS_TOKEN = "<|end|>"
PAD_TOKEN = "<|pad|>"
# Special tokens take the first ids, in this order.
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN, PAD_TOKEN, "<|system|>", "<|user|>", "<|assistant|>")
# "developer" (newer OpenAI clients) is treated as "system"; any other role is refused. Tools
# are offered in a system turn and called as <tool_call>{"name": ..., "arguments": ...}</tool_call>
# (mlx-lm's "json_tools" format); tool results come back in a user turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    '{% if tools %}{{ \'<|system|>\\nTools (answer with <tool_call>\\n{"name": ..., '
    '"arguments": ...}\\n</tool_call>):\\n\' }}'
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}{{ '<|end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'system' if message['role'] == 'developer' else message['role'] %}"
    "{% if role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unsupported chat role: ' + role) }}"
    "{% endif %}"
    "{% if role == 'tool' %}"
    "{{ '<|user|>\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|end|>\\n' }}"
    "{% else %}"
    "{{ '<|' + role + '|>\\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set tool_call = call['function'] %}"
    '{{ \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{ tool_call.arguments | tojson }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
MAX_POSITIONS = 4096
DEFAULT_HEAD_DIM = 32
PRINTABLE = frozenset(string.ascii_letters + string.digits + string.punctuation + " \n")

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **ARCHITECTURE_NAMES,  # built from mlx-lm's class by demo_architectures.py
}
HAND_WRITTEN = frozenset({"llama", "qwen3"})
QUANTIZE_BITS = (4, 8)
QUANTIZE_GROUP_SIZE = 32  # divides every demo dimension (hidden and heads x head_dim >= 32)
ROPE_THETA = {"llama": 10000.0, "qwen3": 1000000.0}
RMS_NORM_EPS = {"llama": 1e-5, "qwen3": 1e-6}
# The safetensors tag of each weight dtype a demo model can be written in.
DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}

# Initial scales, tuned by measuring distinct tokens in greedy generations: unit-variance
# embeddings and fan-in-scaled linears with gain 2 make every layer's contribution outweigh
# the residual stream, so the output depends on the whole context and greedy decoding
# wanders instead of repeating one token. Logits get a standard deviation of HEAD_GAIN.
EMBEDDING_STD = 1.0
LINEAR_GAIN = 2.0
HEAD_GAIN = 4.0
TIED_EMBEDDING_STD = 0.6
GAINS = {
    "embedding_std": EMBEDDING_STD,
    "tied_embedding_std": TIED_EMBEDDING_STD,
    "linear_gain": LINEAR_GAIN,
    "head_gain": HEAD_GAIN,
}


@dataclass(frozen=True, slots=True)
class DemoSpec:
    """What demo model to build. The same spec always gives byte-identical files."""

    arch: str = "llama"
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    hidden: int | None = None  # None: heads * head_dim (so any head count just works)
    intermediate: int | None = None  # None: 2 * hidden
    head_dim: int | None = None  # None: hidden // heads, or DEFAULT_HEAD_DIM without hidden
    vocab: int = 1024  # target size of the trained tokenizer (config.vocab_size = actual size)
    tied: bool | None = None  # None: llama untied, qwen3 tied (as the real families ship)
    seed: int = 0
    dtype: str = "float32"
    quantize: int | None = None  # bits (4 or 8): quantized with mlx-lm's converter

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"demo arch {self.arch!r} is not one of {sorted(ARCHITECTURES)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"demo dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        for name in ("layers", "heads", "kv_heads", "hidden", "head_dim", "intermediate"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"demo {name} must be >= 1, got {value}")
        # transformers (which loads the tokenizer) refuses configs that break this.
        if self.hidden_size % self.heads:
            raise ConfigError(
                f"demo hidden ({self.hidden_size}) must be a multiple of heads ({self.heads})"
            )
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"demo heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )
        if self.head_size % 2:
            raise ConfigError(
                f"demo head_dim must be even (RoPE rotates pairs), got {self.head_size} "
                f"(hidden {self.hidden_size}, heads {self.heads}); pass head_dim or another hidden"
            )
        if self.quantize is not None and self.quantize not in QUANTIZE_BITS:
            raise ConfigError(f"demo quantize must be one of {QUANTIZE_BITS}, got {self.quantize}")
        if not 300 <= self.vocab <= 65536:
            raise ConfigError(f"demo vocab must be in 300..65536, got {self.vocab}")

    @property
    def hidden_size(self) -> int:
        if self.hidden is not None:
            return self.hidden
        return self.heads * (self.head_dim or DEFAULT_HEAD_DIM)

    @property
    def head_size(self) -> int:
        if self.head_dim is not None:
            return self.head_dim
        return self.hidden_size // self.heads

    @property
    def intermediate_size(self) -> int:
        return self.intermediate if self.intermediate is not None else 2 * self.hidden_size

    @property
    def tie_embeddings(self) -> bool:
        if self.tied is not None:
            return self.tied
        return self.arch == "qwen3" or self.arch in TIED_BY_DEFAULT

    def digest(self) -> str:
        """A short hash of everything that determines the files: spec, generator, corpus."""
        fields = dataclasses.asdict(self)
        if fields["quantize"] is None:
            del fields["quantize"]  # added later: unquantized specs keep their digests
        payload = (
            json.dumps(
                {"spec": fields, "generator": GENERATOR_VERSION},
                sort_keys=True,
            ).encode()
            + hashlib.sha256(CORPUS_PATH.read_bytes()).digest()
        )
        return hashlib.sha256(payload).hexdigest()[:12]


DEFAULT_SPEC = DemoSpec()


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
        vocab_size = _count_token_ids(tokenizer_json)
        advance("tokenizer")
        _write_text(staging / "tokenizer.json", tokenizer_json)
        _write_text(staging / "tokenizer_config.json", _dump(_tokenizer_config()))
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


@functools.lru_cache(maxsize=4)
def _train_tokenizer(vocab_size: int) -> str:
    """Train a byte-level BPE tokenizer on the shipped corpus; returns tokenizer.json text.

    The tokenizers trainer is deterministic for a fixed input (verified across processes in
    tests/model/test_demo_model.py), and it runs once per process per vocab size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS_PATH.read_text(encoding="utf-8").splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer.to_str(pretty=True)


@functools.lru_cache(maxsize=4)
def _silent_ids(tokenizer_json: str) -> tuple[int, ...]:
    """Ids the model should never emit: special tokens and tokens that are not printable text."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    silent = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if token_id < len(SPECIAL_TOKENS) or not set(text) <= PRINTABLE:
            silent.append(token_id)
    return tuple(silent)


def _count_token_ids(tokenizer_json: str) -> int:
    """One past the largest token id, counting added (special) tokens."""
    content = json.loads(tokenizer_json)
    ids = list(content["model"]["vocab"].values()) + [t["id"] for t in content["added_tokens"]]
    return max(ids) + 1


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
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


def _make_weights(
    spec: DemoSpec, vocab_size: int, silent_ids: tuple[int, ...]
) -> dict[str, np.ndarray]:
    """Seeded float32 weights in mlx-lm's naming, drawn in one fixed order."""
    rng = np.random.default_rng(spec.seed)
    hidden, inner, head_dim = spec.hidden_size, spec.intermediate_size, spec.head_size

    def linear(out_features: int, in_features: int, gain: float = LINEAR_GAIN) -> np.ndarray:
        weight = rng.standard_normal((out_features, in_features), dtype=np.float32)
        return weight * np.float32(gain / np.sqrt(in_features))

    ones = functools.partial(np.ones, dtype=np.float32)
    embedding_std = TIED_EMBEDDING_STD if spec.tie_embeddings else EMBEDDING_STD
    embedding = rng.standard_normal((vocab_size, hidden), dtype=np.float32)
    weights = {"model.embed_tokens.weight": embedding * np.float32(embedding_std)}
    for index in range(spec.layers):
        prefix = f"model.layers.{index}"
        weights[f"{prefix}.input_layernorm.weight"] = ones(hidden)
        weights[f"{prefix}.self_attn.q_proj.weight"] = linear(spec.heads * head_dim, hidden)
        weights[f"{prefix}.self_attn.k_proj.weight"] = linear(spec.kv_heads * head_dim, hidden)
        weights[f"{prefix}.self_attn.v_proj.weight"] = linear(spec.kv_heads * head_dim, hidden)
        weights[f"{prefix}.self_attn.o_proj.weight"] = linear(hidden, spec.heads * head_dim)
        if spec.arch == "qwen3":
            weights[f"{prefix}.self_attn.q_norm.weight"] = ones(head_dim)
            weights[f"{prefix}.self_attn.k_norm.weight"] = ones(head_dim)
        weights[f"{prefix}.post_attention_layernorm.weight"] = ones(hidden)
        weights[f"{prefix}.mlp.gate_proj.weight"] = linear(inner, hidden)
        weights[f"{prefix}.mlp.up_proj.weight"] = linear(inner, hidden)
        weights[f"{prefix}.mlp.down_proj.weight"] = linear(hidden, inner)
    # Random signs on the final norm: with tied embeddings the current token's own embedding
    # in the residual would otherwise score highest and greedy decoding would repeat it.
    signs = np.where(rng.random(hidden) < 0.5, -1.0, 1.0).astype(np.float32)
    if spec.tie_embeddings:
        output = weights["model.embed_tokens.weight"]
        # Bring the logits to the spread an untied head gives: std HEAD_GAIN.
        weights["model.norm.weight"] = signs * np.float32(
            HEAD_GAIN / (embedding_std * np.sqrt(hidden))
        )
    else:
        output = weights["lm_head.weight"] = linear(vocab_size, hidden, HEAD_GAIN)
        weights["model.norm.weight"] = signs
    # Zero output rows score exactly 0, far below the best of ~1000 random logits, so greedy
    # decoding never picks them: no random EOS (generations run to max_tokens) and no lone
    # control or partial UTF-8 bytes (the text stays printable).
    output[list(silent_ids)] = 0.0
    return weights


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray], spec: DemoSpec) -> None:
    """Write a safetensors file with sorted names, so equal tensors give equal bytes."""
    tag = DTYPES[spec.dtype]
    blobs: list[bytes] = []
    header: dict[str, object] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name in sorted(tensors):
        blob = _encode(tensors[name], spec.dtype)
        header[name] = {
            "dtype": tag,
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header_bytes)))
        handle.write(header_bytes)
        for blob in blobs:
            handle.write(blob)
        handle.flush()
        os.fsync(handle.fileno())


def _encode(array: np.ndarray, dtype: str) -> bytes:
    array = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == "float32":
        return array.astype("<f4").tobytes()
    if dtype == "float16":
        return array.astype("<f2").tobytes()
    # bfloat16: the high half of float32, rounded to nearest even.
    bits = array.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def _dump(value: dict) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
