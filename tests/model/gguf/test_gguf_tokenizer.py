"""The tokenizer rebuilt from a GGUF: ids equal to the GGUF vocabulary's and to llama.cpp's
tokenization on a corpus (digits, unicode, whitespace runs, code, every special token), for the
real SmolLM2 byte-level BPE and for a SentencePiece vocabulary trained here; the files mlx-lm
loads (chat template, BOS, the ids that end a generation); clear refusals."""

from __future__ import annotations

import io
import json
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer

from engines.model.gguf.tokenizer import read_vocabulary, write_tokenizer
from errors import ModelError
from tests.helpers.real_models import smollm2_gguf
from tests.helpers.tokenizer_corpus import CORPUS

CORPUS_PATH = Path(__file__).parents[3] / "engines" / "model" / "data" / "corpus.txt"


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


@pytest.fixture(scope="module")
def sentencepiece_model():
    """A SentencePiece BPE vocabulary trained on the demo corpus, shaped like Llama's: byte
    fallback, whitespace-only pieces, split digits, no normalization, a control and a
    user-defined symbol."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS_PATH.read_text(encoding="utf-8").splitlines()),
        model_writer=model,
        vocab_size=1000,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        control_symbols=["<|turn_end|>"],
        user_defined_symbols=["<tool_call>"],
        minloglevel=2,
    )
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())


def piece_type(processor, piece_id: int) -> int:
    for kind, test in (
        (gguf.TokenType.UNKNOWN, processor.is_unknown),
        (gguf.TokenType.CONTROL, processor.is_control),
        (gguf.TokenType.BYTE, processor.is_byte),
        (gguf.TokenType.UNUSED, processor.is_unused),
    ):
        if test(piece_id):
            return kind
    user_defined = processor.id_to_piece(piece_id) == "<tool_call>"
    return gguf.TokenType.USER_DEFINED if user_defined else gguf.TokenType.NORMAL


@pytest.fixture(scope="module")
def sentencepiece_dir(sentencepiece_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The vocabulary written to a GGUF the way llama.cpp's converter writes a Llama one."""
    root = tmp_path_factory.mktemp("sentencepiece")
    size = sentencepiece_model.get_piece_size()
    path = write_vocabulary_gguf(
        root / "spm.gguf",
        "llama",
        [sentencepiece_model.id_to_piece(i) for i in range(size)],
        token_scores=[sentencepiece_model.get_score(i) for i in range(size)],
        token_types=[piece_type(sentencepiece_model, i) for i in range(size)],
        bos_token_id=sentencepiece_model.bos_id(),
        eos_token_id=sentencepiece_model.eos_id(),
        unk_token_id=sentencepiece_model.unk_id(),
        eot_token_id=sentencepiece_model.piece_to_id("<|turn_end|>"),
        add_bos_token=True,
        add_space_prefix=True,
        chat_template=(
            "{{ bos_token }}{% for m in messages %}{{ m['content'] }}<|turn_end|>{% endfor %}"
        ),
    )
    write_tokenizer(gguf.GGUFReader(path), root / "model")
    return root / "model"


def test_sentencepiece_ids_equal_sentencepiece(
    sentencepiece_model, sentencepiece_dir: Path
) -> None:
    tokenizer = load_tokenizer(sentencepiece_dir)
    size = sentencepiece_model.get_piece_size()
    assert tokenizer.get_vocab_size(with_added_tokens=True) == size
    assert [tokenizer.id_to_token(i) for i in range(size)] == [
        sentencepiece_model.id_to_piece(i) for i in range(size)
    ]
    bos = sentencepiece_model.bos_id()
    lines = CORPUS_PATH.read_text(encoding="utf-8").splitlines()[:40]
    for text in (*CORPUS, *lines):
        assert tokenizer.encode(text).ids == [bos, *sentencepiece_model.encode(text)], text
        assert tokenizer.decode(tokenizer.encode(text).ids) == text
    # The corpus reaches byte fallback: CJK, emoji, tabs.
    used = {piece for text in CORPUS for piece in tokenizer.encode(text).tokens}
    assert {"<0xE6>", "<0xF0>", "<0x09>"} <= used


def test_sentencepiece_special_tokens_as_llama_cpp(
    sentencepiece_model, sentencepiece_dir: Path
) -> None:
    """llama.cpp matches control and user-defined tokens whole, and gives the text after each
    one its own leading space, as if it began the prompt."""
    tokenizer = load_tokenizer(sentencepiece_dir)
    encode = sentencepiece_model.encode
    turn_end = sentencepiece_model.piece_to_id("<|turn_end|>")
    tool_call = sentencepiece_model.piece_to_id("<tool_call>")
    bos, eos = sentencepiece_model.bos_id(), sentencepiece_model.eos_id()
    cases = {
        "Hello<|turn_end|>": [*encode("Hello"), turn_end],
        "<|turn_end|>  next line\n": [turn_end, *encode("  next line\n")],
        'say <tool_call>{"a": 1}</s>x': [
            *encode("say "),
            tool_call,
            *encode('{"a": 1}'),
            eos,
            *encode("x"),
        ],
        "<s><unk></s><|turn_end|><tool_call>": [bos, 0, eos, turn_end, tool_call],
        "": [],
    }
    for text, want in cases.items():
        assert tokenizer.encode(text).ids == [bos, *want], text


def test_sentencepiece_files_load_in_mlx_lm(sentencepiece_model, sentencepiece_dir: Path) -> None:
    from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer, load
    from mlx_lm.utils import load_config

    (sentencepiece_dir / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    config = load_config(sentencepiece_dir)
    turn_end = sentencepiece_model.piece_to_id("<|turn_end|>")
    assert config["eos_token_id"] == [2, turn_end]  # EOS and EOT both end a generation
    wrapper = load(sentencepiece_dir, eos_token_ids=config["eos_token_id"])
    assert wrapper.eos_token_ids == {2, turn_end}
    assert isinstance(wrapper.detokenizer, SPMStreamingDetokenizer)
    # The template writes BOS itself, as real SentencePiece templates do; it appears once.
    prompt = wrapper.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert prompt == [1, *sentencepiece_model.encode("Hi there"), turn_end]
