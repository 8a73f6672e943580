"""The demo models' tokenizer: a byte-level BPE trained on the shipped corpus (data/corpus.txt),
its special tokens and chat template (or a thinking one), and the ids a demo model must never
emit. Training is deterministic, so the same vocab size always gives the same tokenizer.json
text.
"""

from __future__ import annotations

import functools
import json
import string
from pathlib import Path

CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"
BOS_TOKEN = "<|begin|>"
EOS_TOKEN = "<|end|>"
PAD_TOKEN = "<|pad|>"
# Special tokens take the first ids, in this order.
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN, PAD_TOKEN, "<|system|>", "<|user|>", "<|assistant|>")
# Thinking demo models (DemoSpec(thinking=True)) add these two tokens after the trained
# vocabulary, so every other id stays the same; they are plain added tokens (decoded as text,
# as Qwen3 ships them), which is how mlx-lm's tokenizer finds them (`has_thinking`).
THINK_START = "<think>"
THINK_END = "</think>"
# "developer" (newer OpenAI clients) is treated as "system"; any other role is refused. Tools
# are offered in a system turn and called as <tool_call>{"name": ..., "arguments": ...}</tool_call>
# (mlx-lm's "json_tools" format); tool results come back in a user turn.
_TOOLS = (
    "{{ bos_token }}"
    '{% if tools %}{{ \'<|system|>\\nTools (answer with <tool_call>\\n{"name": ..., '
    '"arguments": ...}\\n</tool_call>):\\n\' }}'
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}{{ '<|end|>\\n' }}"
    "{% endif %}"
)
_ROLE = (
    "{% for message in messages %}"
    "{% set role = 'system' if message['role'] == 'developer' else message['role'] %}"
    "{% if role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unsupported chat role: ' + role) }}"
    "{% endif %}"
    "{% if role == 'tool' %}"
    "{{ '<|user|>\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|end|>\\n' }}"
    "{% else %}"
)
_TEXT = "{{ '<|' + role + '|>\\n' + (message['content'] or '') }}"
# An assistant turn's earlier thought, passed back, is rendered before its text.
_THOUGHT_AND_TEXT = (
    "{{ '<|' + role + '|>\\n' }}"
    "{% if role == 'assistant' and message.get('reasoning_content') %}"
    "{{ '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}"
    "{% endif %}"
    "{{ message['content'] or '' }}"
)
_CALLS_AND_END = (
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set tool_call = call['function'] %}"
    '{{ \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{ tool_call.arguments | tojson }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
)
CHAT_TEMPLATE = (
    _TOOLS
    + _ROLE
    + _TEXT
    + _CALLS_AND_END
    + "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# As Qwen3's: thinking is on unless `enable_thinking` is false. On, the reply starts inside
# a thought; off, after an empty one.
THINKING_CHAT_TEMPLATE = (
    _TOOLS
    + _ROLE
    + _THOUGHT_AND_TEXT
    + _CALLS_AND_END
    + "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)
PRINTABLE = frozenset(string.ascii_letters + string.digits + string.punctuation + " \n")


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
def _with_think_tokens(tokenizer_json: str) -> str:
    """The tokenizer with THINK_START and THINK_END added after every trained id."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.add_tokens(
        [AddedToken(marker, special=False, normalized=False) for marker in (THINK_START, THINK_END)]
    )
    return tokenizer.to_str(pretty=True)


@functools.lru_cache(maxsize=4)
def _silent_ids(tokenizer_json: str) -> tuple[int, ...]:
    """Ids the model should never emit: added tokens (the special ones and the think markers)
    and tokens that are not printable text.

    Random weights would open or close a thought at an arbitrary step, so a thinking demo
    model never does: with thinking on, all it writes is reasoning.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    added = set(tokenizer.get_added_tokens_decoder())
    silent = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if token_id in added or not set(text) <= PRINTABLE:
            silent.append(token_id)
    return tuple(silent)


def _count_token_ids(tokenizer_json: str) -> int:
    """One past the largest token id, counting added (special) tokens."""
    content = json.loads(tokenizer_json)
    ids = list(content["model"]["vocab"].values()) + [t["id"] for t in content["added_tokens"]]
    return max(ids) + 1
