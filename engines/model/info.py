"""Facts about a model directory, read from config.json and safetensors headers (no weights)."""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from errors import ModelError

if TYPE_CHECKING:
    from planner import ModelShape

# The weight files mlx-lm loads (mlx_lm.utils.load_model globs the same pattern).
WEIGHT_GLOB = "model*.safetensors"
# A header larger than this is corrupt, not a model (real ones are a few MB at most).
MAX_HEADER_BYTES = 100 * 1024 * 1024
FLOAT_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
# Name components that mark the token embedding and the output head across families.
EMBEDDING_NAMES = frozenset({"embed_tokens", "wte", "tok_embeddings", "word_embeddings"})
HEAD_NAMES = frozenset({"lm_head"})
REQUIRED_KEYS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "vocab_size",
)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the planner and the API need to know about one model directory."""

    path: Path
    model_type: str
    num_layers: int
    hidden_size: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    dtype_bytes: int  # element size of the model's floating-point tensors (activations)
    weight_bytes: int  # every tensor in the weight files, as stored (quantized or not)
    embedding_bytes: int
    head_bytes: int  # 0 when the head reuses the embedding
    has_tp_variant: bool  # mlx-lm's Model class defines shard(group)
    has_pipeline_variant: bool  # mlx-lm's Model class defines pipeline(group)
    intermediate_size: int = 0  # MLP width; 0 when the config does not say
    quantized: bool = False
    pipeline_problem: str = ""  # why tandem's pipeline engine cannot split it ("" when it can)
    repo_id: str | None = None  # the Hugging Face repo the directory is a snapshot of
    revision: str | None = None  # its commit (or the revision asked for)

    @property
    def reference(self) -> str:
        """What another machine resolves to the same files: repo@commit, or the path."""
        if self.repo_id is None:
            return str(self.path.resolve())  # never a relative path another machine misreads
        return f"{self.repo_id}@{self.revision or 'main'}"

    @property
    def display_name(self) -> str:
        """The model as people name it: repo@commit (shortened), or the directory."""
        if self.repo_id is None:
            return str(self.path)
        return f"{self.repo_id}@{(self.revision or 'main')[:12]}"

    @property
    def can_upcast(self) -> bool:
        """Half-precision, not quantized: worth computing in float32 on the CPU."""
        return self.dtype_bytes == 2 and not self.quantized

    def to_shape(
        self, float32: bool = False, kv_bits: int = 0, quantized_kv_start: int = 0
    ) -> ModelShape:
        """The planner's view of this model; `float32`: as computed upcast (twice the bytes);
        `kv_bits`: with its KV cache quantized to that many bits once a sequence holds
        `quantized_kv_start` tokens."""
        from planner import ModelShape

        scale = 4 // self.dtype_bytes if float32 and self.can_upcast else 1
        return ModelShape(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            attention_heads=self.attention_heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            weight_bytes=self.weight_bytes * scale,
            embedding_bytes=self.embedding_bytes * scale,
            head_bytes=self.head_bytes * scale,
            tied_embeddings=self.tied_embeddings,
            dtype_bytes=self.dtype_bytes * scale,
            has_tp_variant=self.has_tp_variant,
            intermediate_size=self.intermediate_size,
            pipeline_problem=self.pipeline_problem,
            kv_bits=kv_bits,
            quantized_kv_start=quantized_kv_start if kv_bits else 0,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready facts (for /v1/cluster and `tandem plan`)."""
        facts = asdict(self)
        facts["path"] = str(self.path)
        return facts


def inspect_model(path: Path | str) -> ModelFacts:
    """Read the facts of the model in `path`; raises ModelError naming what is wrong."""
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"{path}: model directory does not exist")
    config = read_config(path)
    tensors = read_tensor_table(path)

    model_type = _require(config, "model_type", str, path)
    num_layers = _require(config, "num_hidden_layers", int, path)
    hidden_size = _require(config, "hidden_size", int, path)
    attention_heads = _require(config, "num_attention_heads", int, path)
    vocab_size = _require(config, "vocab_size", int, path)
    kv_heads = _optional(config, "num_key_value_heads", path) or attention_heads
    head_dim = _optional(config, "head_dim", path) or hidden_size // attention_heads

    embedding_bytes = _bytes_named(tensors, EMBEDDING_NAMES)
    head_tensor_bytes = _bytes_named(tensors, HEAD_NAMES)
    # mlx-lm drops a stored lm_head when the config ties it; without the key, trust the files.
    tied = _lookup(config, "tie_word_embeddings")
    tied_embeddings = bool(tied) if tied is not None else head_tensor_bytes == 0
    has_tp_variant, has_pipeline_variant = _mlx_lm_variants(config, path)

    return ModelFacts(
        path=path,
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden_size,
        attention_heads=attention_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        tied_embeddings=tied_embeddings,
        dtype_bytes=_dominant_float_bytes(tensors, config),
        weight_bytes=sum(nbytes for _, nbytes in tensors.values()),
        embedding_bytes=embedding_bytes,
        head_bytes=0 if tied_embeddings else head_tensor_bytes,
        has_tp_variant=has_tp_variant,
        has_pipeline_variant=has_pipeline_variant,
        intermediate_size=int(_lookup(config, "intermediate_size") or 0),
        quantized=bool(_lookup(config, "quantization") or _lookup(config, "quantization_config")),
        pipeline_problem=_pipeline_problem(config),
    )


def read_config(path: Path) -> dict[str, Any]:
    """config.json of the model in `path`, as a dict."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelError(f"{path}: no config.json (is this a model directory?)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelError(f"{config_path}: cannot read config.json: {error}") from error
    if not isinstance(config, dict):
        raise ModelError(f"{config_path}: config.json is not a JSON object")
    for key in REQUIRED_KEYS:
        if _lookup(config, key) is None:
            raise ModelError(f"{config_path}: config.json has no {key!r}")
    return config


def read_tensor_table(path: Path) -> dict[str, tuple[str, int]]:
    """Every tensor in the weight files of `path`: name -> (safetensors dtype, byte size)."""
    files = sorted(path.glob(WEIGHT_GLOB))
    if not files:
        raise ModelError(f"{path}: no {WEIGHT_GLOB} weight files")
    tensors: dict[str, tuple[str, int]] = {}
    for file in files:
        for name, entry in _read_header(file).items():
            if name == "__metadata__":
                continue
            try:
                begin, end = entry["data_offsets"]
                tensors[name] = (str(entry["dtype"]), int(end) - int(begin))
            except (KeyError, TypeError, ValueError) as error:
                raise ModelError(f"{file}: bad safetensors entry for {name!r}") from error
    return tensors


def _read_header(file: Path) -> dict[str, Any]:
    """The JSON header of one safetensors file: 8-byte little-endian length, then JSON."""
    try:
        with open(file, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise ModelError(f"{file}: truncated safetensors file")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(MAX_HEADER_BYTES, file.stat().st_size - 8):
                raise ModelError(f"{file}: safetensors header length {length} is impossible")
            header = json.loads(handle.read(length))
    except OSError as error:
        raise ModelError(f"{file}: cannot read weights: {error}") from error
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelError(f"{file}: malformed safetensors header: {error}") from error
    if not isinstance(header, dict):
        raise ModelError(f"{file}: safetensors header is not a JSON object")
    return header


def _lookup(config: dict[str, Any], key: str) -> Any:
    """A config value, also looked up in text_config (multimodal checkpoints nest it there)."""
    if key in config:
        return config[key]
    text_config = config.get("text_config")
    if isinstance(text_config, dict):
        return text_config.get(key)
    return None


def _require(config: dict[str, Any], key: str, kind: type, path: Path) -> Any:
    value = _lookup(config, key)
    # bool is an int in Python; a flag where a count belongs is still malformed.
    if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 1):
        raise ModelError(f"{path / 'config.json'}: {key!r} must be a positive {kind.__name__}")
    return value


def _optional(config: dict[str, Any], key: str, path: Path) -> int | None:
    if _lookup(config, key) is None:
        return None
    return _require(config, key, int, path)


def _bytes_named(tensors: dict[str, tuple[str, int]], names: frozenset[str]) -> int:
    return sum(
        nbytes for name, (_, nbytes) in tensors.items() if names.intersection(name.split("."))
    )


def _dominant_float_bytes(tensors: dict[str, tuple[str, int]], config: dict[str, Any]) -> int:
    """Element size of the floating dtype holding the most bytes (norms, scales if quantized)."""
    totals: Counter[str] = Counter()
    for dtype, nbytes in tensors.values():
        if dtype in FLOAT_DTYPE_BYTES:
            totals[dtype] += nbytes
    if totals:
        return FLOAT_DTYPE_BYTES[totals.most_common(1)[0][0]]
    declared = str(_lookup(config, "torch_dtype") or "bfloat16")
    return 4 if declared == "float32" else 2


def _mlx_lm_variants(config: dict[str, Any], path: Path) -> tuple[bool, bool]:
    """Whether mlx-lm's Model class for this config can shard (tp) and pipeline (pp)."""
    from mlx_lm.utils import _get_classes

    try:
        model_class, _ = _get_classes(config)
    except ValueError as error:
        raise ModelError(f"{path}: mlx-lm cannot run this model: {error}") from error
    return callable(getattr(model_class, "shard", None)), callable(
        getattr(model_class, "pipeline", None)
    )


def _pipeline_problem(config: dict[str, Any]) -> str:
    """Why the pipeline engine cannot split this architecture ('' when it can)."""
    from engines.model.layers import pipeline_problem

    return pipeline_problem(config)
