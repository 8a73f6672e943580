"""A GGUF's tokenizer rebuilt as the files mlx-lm and transformers load: tokenizer.json (ids equal
to the GGUF vocabulary's, text split as llama.cpp splits it), its config, and the ids that end a
generation.

Built with `tokenizers` itself rather than transformers' GGUF converter: that converter adds
tokens the file does not have (`<|endoftext|>`, `<s>`, `</s>`) past the vocabulary, falls back to
GPT-2's split for pre-tokenizers it does not know (SmolLM's digit split among them), and puts
SentencePiece's leading space only before the first piece of text, where llama.cpp puts one after
every special token too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, TokenType
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from errors import ModelError

SPACE_MARK = "\u2581"  # SentencePiece's ▁, which stands for a space inside its pieces

# The split patterns of the original tokenizers, as llama.cpp applies them (one after another,
# each on the pieces the last left).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DIGIT_SPLIT = r"\p{N}"


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    """How llama.cpp cuts text before BPE for one `tokenizer.ggml.pre` name."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself in the vocabulary is emitted whole
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


GPT2 = PreTokenizer((GPT2_SPLIT,))
DIGITS_THEN_GPT2 = PreTokenizer((DIGIT_SPLIT, GPT2_SPLIT))
LLAMA3 = PreTokenizer((LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
QWEN2 = PreTokenizer((QWEN2_SPLIT,))
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo"), GPT2),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        DIGITS_THEN_GPT2,
    ),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), LLAMA3),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((LLAMA3_SPLIT,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), QWEN2),
    # What llama.cpp uses for a file that names no pre-tokenizer.
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")),
}
# Token types whose text llama.cpp matches whole in a prompt, before any splitting.
SPECIAL_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN)
# tokenizer_config.json's names for the tokens the GGUF names tokenizer.ggml.<name>_token_id.
SPECIAL_TOKEN_NAMES = {
    "bos_token": "bos",
    "eos_token": "eos",
    "unk_token": "unknown",
    "pad_token": "padding",
}


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """The tokenizer metadata of a GGUF, as plain values."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[str]
    metadata: dict[str, Any]  # every other tokenizer.* scalar, by key

    def special_id(self, name: str) -> int | None:
        """The id under tokenizer.ggml.<name>_token_id, if the file names a valid one."""
        value = self.metadata.get(f"tokenizer.ggml.{name}_token_id")
        return int(value) if value is not None and 0 <= value < len(self.tokens) else None

    def token(self, name: str) -> str | None:
        token_id = self.special_id(name)
        return None if token_id is None else self.tokens[token_id]


def write_tokenizer(reader: GGUFReader, out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and
    generation_config.json (the ids that end a generation) for the GGUF's vocabulary."""
    vocabulary = read_vocabulary(reader)
    tokenizer, add_bos = build_tokenizer(vocabulary)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special = {
        key: token
        for key, name in SPECIAL_TOKEN_NAMES.items()
        if (token := vocabulary.token(name)) is not None
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": add_bos,
        "add_eos_token": bool(vocabulary.metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    if (template := vocabulary.metadata.get("tokenizer.chat_template")) is not None:
        config["chat_template"] = template
    write_json(out_dir / "tokenizer_config.json", config)
    write_json(out_dir / "special_tokens_map.json", special)
    generation = {"eos_token_id": end_of_generation_ids(vocabulary)}
    if (bos_id := vocabulary.special_id("bos")) is not None:
        generation["bos_token_id"] = bos_id
    write_json(out_dir / "generation_config.json", generation)


def read_vocabulary(reader: GGUFReader) -> Vocabulary:
    fields = reader.fields
    model = scalar(reader, "tokenizer.ggml.model")
    if model is None:
        raise ModelError("the GGUF has no tokenizer (no tokenizer.ggml.model); it cannot be served")
    tokens = string_array(reader, "tokenizer.ggml.tokens")
    types = number_array(reader, "tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    metadata = {
        key: scalar(reader, key)
        for key, field in fields.items()
        if key.startswith("tokenizer.") and field.types[:1] != [GGUFValueType.ARRAY]
    }
    return Vocabulary(
        model=model,
        pre=scalar(reader, "tokenizer.ggml.pre") or "default",
        tokens=tokens,
        types=[int(t) for t in types],
        scores=number_array(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens),
        merges=string_array(reader, "tokenizer.ggml.merges"),
        metadata=metadata,
    )


def build_tokenizer(vocabulary: Vocabulary) -> tuple[Tokenizer, bool]:
    """The `tokenizers` tokenizer of a vocabulary, and whether it starts each text with BOS."""
    if vocabulary.model == "gpt2":
        tokenizer, add_bos_default = (
            byte_level_tokenizer(vocabulary),
            pre_tokenizer(vocabulary).add_bos,
        )
    elif vocabulary.model == "llama":
        tokenizer, add_bos_default = sentencepiece_tokenizer(vocabulary), True
    else:
        raise ModelError(
            f"the GGUF's tokenizer model {vocabulary.model!r} is not supported; tandem reads "
            "'gpt2' (byte-level BPE) and 'llama' (SentencePiece) vocabularies"
        )
    tokenizer.add_special_tokens(added_tokens(vocabulary, special=True))
    tokenizer.add_tokens(added_tokens(vocabulary, special=False))
    add_bos = bool(vocabulary.metadata.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(vocabulary.metadata.get("tokenizer.ggml.add_eos_token", False))
    tokenizer.post_processor = bos_eos_processor(vocabulary, add_bos, add_eos)
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(vocabulary.tokens):
        raise ModelError(
            f"the rebuilt tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} ids "
            f"but the GGUF vocabulary {len(vocabulary.tokens)}"
        )
    return tokenizer, add_bos


def pre_tokenizer(vocabulary: Vocabulary) -> PreTokenizer:
    try:
        return PRE_TOKENIZERS[vocabulary.pre]
    except KeyError:
        raise ModelError(
            f"the GGUF's pre-tokenizer {vocabulary.pre!r} (tokenizer.ggml.pre) is not supported; "
            f"tandem knows {', '.join(sorted(PRE_TOKENIZERS))}"
        ) from None


def byte_level_tokenizer(vocabulary: Vocabulary) -> Tokenizer:
    """GPT-2-style BPE: tokens are spelled in the byte alphabet, merges come from the file."""
    split = pre_tokenizer(vocabulary)
    merges = [split_merge(merge) for merge in vocabulary.merges]
    model = models.BPE(
        vocab=unique_vocab(vocabulary.tokens), merges=merges, ignore_merges=split.ignore_merges
    )
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in split.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece_tokenizer(vocabulary: Vocabulary) -> Tokenizer:
    """SentencePiece BPE as llama.cpp runs it: spaces become ▁, pieces merge best score first,
    and a character the vocabulary lacks falls back to its <0xNN> byte tokens."""
    vocab = unique_vocab(vocabulary.tokens)
    unknown = vocabulary.token("unknown")
    model = models.BPE(
        vocab=vocab,
        merges=merges_by_score(vocabulary, vocab),
        unk_token=unknown,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    add_space_prefix = bool(vocabulary.metadata.get("tokenizer.ggml.add_space_prefix", True))
    # A normalizer runs on each piece of text between special tokens, so the prefix space goes
    # after every special token as in llama.cpp (Metaspace would add it only at the start).
    steps = [normalizers.Prepend(" ")] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE_MARK)])
    decoding = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decoding.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decoding)
    return tokenizer


def merges_by_score(vocabulary: Vocabulary, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every pair of pieces whose join is a piece, best joined score first: llama.cpp merges the
    adjacent pair whose join scores highest, which BPE does when its merges rank that way."""
    candidates = []
    for token_id, (piece, token_type) in enumerate(
        zip(vocabulary.tokens, vocabulary.types, strict=True)
    ):
        if token_type == TokenType.BYTE:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                candidates.append((-vocabulary.scores[token_id], token_id, cut, left, right))
    candidates.sort()
    return [(left, right) for _, _, _, left, right in candidates]


def added_tokens(vocabulary: Vocabulary, special: bool) -> list[AddedToken]:
    """Control and unknown tokens (special: skipped when decoding), or user-defined ones: all
    matched whole in a prompt, as llama.cpp does."""
    wanted = SPECIAL_TYPES if special else (TokenType.USER_DEFINED,)
    return [
        AddedToken(token, special=special, normalized=False)
        for token, token_type in zip(vocabulary.tokens, vocabulary.types, strict=True)
        if token_type in wanted and token
    ]


def bos_eos_processor(
    vocabulary: Vocabulary, add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    bos, eos = vocabulary.token("bos"), vocabulary.token("eos")
    if add_bos and bos is None:
        raise ModelError("the GGUF asks for a BOS token (add_bos_token) but names none")
    if add_eos and eos is None:
        raise ModelError("the GGUF asks for an EOS token (add_eos_token) but names none")
    before = [f"{bos}:0"] if add_bos else []
    after = [f"{eos}:0"] if add_eos else []
    return processors.TemplateProcessing(
        single=[*before, "$A:0", *after],
        pair=[*before, "$A:0", *after, *before, "$B:1", *after],
        special_tokens=[
            (token, vocabulary.tokens.index(token))
            for token, used in ((bos, add_bos), (eos, add_eos))
            if used and token is not None
        ],
    )


def end_of_generation_ids(vocabulary: Vocabulary) -> list[int]:
    """EOS, then end-of-turn and end-of-message: a chat model ends its answer with the latter."""
    ids = [vocabulary.special_id(name) for name in ("eos", "eot", "eom")]
    return list(dict.fromkeys(token_id for token_id in ids if token_id is not None))


def unique_vocab(tokens: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        if token in vocab:
            raise ModelError(
                f"the GGUF vocabulary spells ids {vocab[token]} and {token_id} both {token!r}; "
                "a tokenizer cannot tell them apart"
            )
        vocab[token] = token_id
    return vocab


def split_merge(merge: str) -> tuple[str, str]:
    cut = merge.find(" ", 1)  # a merge is "LEFT RIGHT"; LEFT may itself be a space
    if cut < 0:
        raise ModelError(f"the GGUF's merge {merge!r} is not two tokens")
    return merge[:cut], merge[cut + 1 :]


def scalar(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def string_array(reader: GGUFReader, key: str) -> list[str]:
    # Decoding the parts directly: field.contents() is ~100x slower on a 150k-entry array.
    field = reader.fields.get(key)
    if field is None:
        return []
    return [bytes(field.parts[index]).decode("utf-8") for index in field.data]


def number_array(reader: GGUFReader, key: str) -> list:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return []
    return np.concatenate([field.parts[index] for index in field.data]).tolist()


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
