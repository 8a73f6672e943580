"""The tokenizer rebuilt from a GGUF: ids equal to the GGUF vocabulary's and to llama.cpp's
tokenization on a corpus (digits, unicode, whitespace runs, code, every special token), for the
real SmolLM2 byte-level BPE and for a SentencePiece vocabulary trained here; the files mlx-lm
loads (chat template, BOS, the ids that end a generation); clear refusals."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer

from engines.model.gguf.tokenizer import read_vocabulary, write_tokenizer
from planner.errors import ModelError
from tests.helpers.smollm2 import smollm2_gguf

CORPUS = (
    "Hello, world! The capital of France is Paris.",
    "3.14159265358979 and 1234567890123 then 1,000,000.00 or 0x1F, 2024-06-30",
    "café naïve résumé Ångström Straße ÉCOLE",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 😀🎉 👍🏽 👨‍👩‍👧 ✓",
    "  two leading spaces",
    "trailing spaces   ",
    "tabs\t\tand\ttabs",
    "lines\n\n\nand\r\nCRLF",
    " \n \t \n    ",
    "def square(x):\n    return x ** 2  # power\n",
    'if (a && b) { printf("%d\\n", a[i]); }',
    "I'm sure they've said it's JSON: {\"key\": [1, 2, 3], 'DON'T': null}",
    "",
)


@pytest.fixture(scope="module")
def smollm2_reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2_gguf())


@pytest.fixture(scope="module")
def smollm2_dir(smollm2_reader: gguf.GGUFReader, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    write_tokenizer(smollm2_reader, out)
    return out


def load_tokenizer(directory: Path) -> Tokenizer:
    return Tokenizer.from_file(str(directory / "tokenizer.json"))


def smollm2_texts(reader: gguf.GGUFReader) -> list[str]:
    """The corpus, every special token alone and all together, and special tokens inside text."""
    vocabulary = read_vocabulary(reader)
    specials = [t for t, kind in zip(vocabulary.tokens, vocabulary.types, strict=True) if kind != 1]
    chat = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    return [*CORPUS, *specials, "".join(specials), " ".join(specials), chat]


def test_smollm2_ids_are_the_gguf_vocabulary(
    smollm2_reader: gguf.GGUFReader, smollm2_dir: Path
) -> None:
    tokenizer = load_tokenizer(smollm2_dir)
    tokens = read_vocabulary(smollm2_reader).tokens
    assert tokenizer.get_vocab_size(with_added_tokens=True) == len(tokens) == 49152
    assert [tokenizer.id_to_token(i) for i in range(len(tokens))] == tokens


def test_smollm2_encodes_as_transformers_gguf_converter(
    smollm2_reader: gguf.GGUFReader, smollm2_dir: Path
) -> None:
    """transformers' own GGUF tokenizer converter, an independent implementation, agrees on
    SmolLM2 (it cannot serve as ours: see the module docstring of the tokenizer)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    vocabulary = read_vocabulary(smollm2_reader)
    reference, _ = convert_gguf_tokenizer(
        "llama",
        {
            "tokenizer_type": "gpt2",
            "pre_tokenizer_type": vocabulary.pre,
            "tokens": vocabulary.tokens,
            "merges": vocabulary.merges,
            "token_type": vocabulary.types,
        },
    )
    tokenizer = load_tokenizer(smollm2_dir)
    texts = smollm2_texts(smollm2_reader)
    got = {text: tokenizer.encode(text).ids for text in texts}
    want = {text: reference.encode(text).ids for text in texts}
    assert got == want
    assert got["3.14159265358979 and 1234567890123 then 1,000,000.00 or 0x1F, 2024-06-30"][:4] == [
        35,
        30,
        33,
        36,  # "3", ".", "1", "4": SmolLM2 splits every digit
    ]


def test_smollm2_special_tokens_are_one_id_each(
    smollm2_reader: gguf.GGUFReader, smollm2_dir: Path
) -> None:
    tokenizer = load_tokenizer(smollm2_dir)
    vocabulary = read_vocabulary(smollm2_reader)
    specials = {
        i: t
        for i, (t, kind) in enumerate(zip(vocabulary.tokens, vocabulary.types, strict=True))
        if kind == 3
    }
    assert len(specials) == 17
    for token_id, token in specials.items():
        assert tokenizer.encode(f"a{token}b").ids == [
            tokenizer.token_to_id("a"),
            token_id,
            tokenizer.token_to_id("b"),
        ]
    # Special tokens are dropped when decoding an answer, plain text comes back byte for byte.
    assert tokenizer.decode(tokenizer.encode("<|im_start|>hi<|im_end|>").ids) == "hi"
    for text in CORPUS:
        assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_smollm2_files_load_in_mlx_lm(smollm2_reader: gguf.GGUFReader, smollm2_dir: Path) -> None:
    from mlx_lm.tokenizer_utils import load
    from mlx_lm.utils import load_config

    (smollm2_dir / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    config = load_config(smollm2_dir)
    assert config["eos_token_id"] == [2]  # generation_config.json's list wins
    wrapper = load(smollm2_dir, eos_token_ids=config["eos_token_id"])
    assert wrapper.eos_token_ids == {2}
    assert wrapper.bos_token == "<|im_start|>" and wrapper.eos_token == "<|im_end|>"
    prompt = wrapper.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    # add_bos_token is false in the GGUF: the template's own tokens start the prompt.
    assert wrapper.encode(prompt)[:2] == [1, 9690]
    assert wrapper.encode(prompt) == load_tokenizer(smollm2_dir).encode(prompt).ids


def write_vocabulary_gguf(path: Path, model: str, tokens: list[str], **fields: object) -> Path:
    """A GGUF holding only a tokenizer: `fields` name GGUFWriter's add_* methods (add_<name>)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    for name, value in fields.items():
        getattr(writer, f"add_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("model", "fields", "message"),
    [
        ("gpt2", {"tokenizer_pre": "mystery-bpe"}, "pre-tokenizer 'mystery-bpe'"),
        ("rwkv", {}, "tokenizer model 'rwkv' is not supported"),
        ("gpt2", {"tokenizer_pre": "gpt-2", "add_bos_token": True}, "names none"),
    ],
)
def test_unsupported_vocabularies_are_refused_by_name(
    tmp_path: Path, model: str, fields: dict, message: str
) -> None:
    path = write_vocabulary_gguf(tmp_path / "v.gguf", model, ["a", "b", "ab"], **fields)
    with pytest.raises(ModelError, match=message):
        write_tokenizer(gguf.GGUFReader(path), tmp_path / "out")
    assert not (tmp_path / "out").exists()
