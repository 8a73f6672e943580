"""Qwen2.5-Coder's tokenizer rebuilt from its real GGUF: ids equal to the GGUF vocabulary, the
corpus encoded as transformers' own GGUF converter encodes it, and each special token (the chat
and tool-call markers among them) one id."""

from __future__ import annotations

import gguf
import pytest
from tokenizers import Tokenizer

from engines.model.gguf.tokenizer import read_vocabulary, write_tokenizer
from tests.helpers.real_models import qwen_coder_gguf
from tests.helpers.tokenizer_corpus import CORPUS

CHAT = (
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call><|im_end|>'
)


@pytest.fixture(scope="module")
def reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(qwen_coder_gguf())


@pytest.fixture(scope="module")
def tokenizer(reader: gguf.GGUFReader, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("qwen-tokenizer")
    write_tokenizer(reader, out)
    return Tokenizer.from_file(str(out / "tokenizer.json"))


def test_ids_are_the_gguf_vocabulary(reader: gguf.GGUFReader, tokenizer: Tokenizer) -> None:
    tokens = read_vocabulary(reader).tokens
    assert tokenizer.get_vocab_size(with_added_tokens=True) == len(tokens) == 151936
    assert [tokenizer.id_to_token(i) for i in range(len(tokens))] == tokens


def test_the_corpus_encodes_as_transformers_gguf_converter(
    reader: gguf.GGUFReader, tokenizer: Tokenizer
) -> None:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    vocabulary = read_vocabulary(reader)
    reference, _ = convert_gguf_tokenizer(
        "qwen2",
        {
            "tokenizer_type": "gpt2",
            "pre_tokenizer_type": vocabulary.pre,
            "tokens": vocabulary.tokens,
            "merges": vocabulary.merges,
            "token_type": vocabulary.types,
        },
    )
    texts = [*CORPUS, CHAT]
    got = {text: tokenizer.encode(text).ids for text in texts}
    assert got == {text: reference.encode(text).ids for text in texts}


def test_the_chat_and_tool_markers_are_one_id_each(tokenizer: Tokenizer) -> None:
    for marker in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<|endoftext|>"):
        marker_id = tokenizer.token_to_id(marker)
        assert marker_id is not None, marker
        assert tokenizer.encode(f"a{marker}b").ids == [
            tokenizer.token_to_id("a"), marker_id, tokenizer.token_to_id("b"),
        ]  # fmt: skip
    for text in CORPUS:
        assert tokenizer.decode(tokenizer.encode(text).ids) == text
