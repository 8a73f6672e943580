"""DemoSpec: which demo model to build (family, sizes, vocab, seed, dtype, quantization), checked
when it is made, and the digest that names its cached directory. The same spec always gives
byte-identical files, so the digest covers the generator's version and the corpus too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from engines.model.demo_architectures import ARCHITECTURE_NAMES, TIED_BY_DEFAULT
from engines.model.demo_tokenizer import CORPUS_PATH
from errors import ConfigError

# Bump when the bytes written for a given spec change, so cached demo models are rebuilt.
GENERATOR_VERSION = 2
DEFAULT_HEAD_DIM = 32
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **ARCHITECTURE_NAMES,  # built from mlx-lm's class by demo_architectures.py
}
QUANTIZE_BITS = (4, 8)
# The safetensors tag of each weight dtype a demo model can be written in.
DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


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
    thinking: bool = False  # <think> markers and a template that thinks (as Qwen3's)

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
        # Added later: unquantized and non-thinking specs keep their digests.
        if fields["quantize"] is None:
            del fields["quantize"]
        if not fields["thinking"]:
            del fields["thinking"]
        payload = (
            json.dumps(
                {"spec": fields, "generator": GENERATOR_VERSION},
                sort_keys=True,
            ).encode()
            + hashlib.sha256(CORPUS_PATH.read_bytes()).digest()
        )
        return hashlib.sha256(payload).hexdigest()[:12]


DEFAULT_SPEC = DemoSpec()
