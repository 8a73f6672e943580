"""The real instruct model in tests: SmolLM2-135M-Instruct imported from its GGUF, the factual
questions it answers right, and mlx-lm's own greedy answers to compare every engine with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.core.request import GenerationRequest

# A short system prompt in place of the template's default one: 27 prompt tokens, not 37, and
# answers that end (EOS) right after the word. CPU decoding of a real model is the suite's
# slowest work.
SYSTEM = "Answer in a few words."
MAX_TOKENS = 12  # every answer below ends with EOS before this


@dataclass(frozen=True, slots=True)
class Question:
    """A chat question and the word a right answer holds."""

    text: str
    answer: str
    max_tokens: int = MAX_TOKENS

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.text}]


@dataclass(frozen=True, slots=True)
class Greedy:
    """One greedy generation: its token ids (EOS left out, as every engine reports them), its
    text, and why it ended ("stop": EOS, "length": max_tokens)."""

    tokens: tuple[int, ...]
    text: str
    finish: str


# What mlx-lm's own generate answers greedily on the import, checked by hand before choosing
# (the 135M model gets other capitals, and 2+2 with a long preamble, wrong or slow).
QUESTIONS = (
    Question("What is the capital of France?", "Paris"),  # The capital of France is Paris.
    Question("What is 3+5?", "8"),  # 3 + 5 = 8
    Question("What is the opposite of hot?", "cold"),  # The opposite of hot is cold.
)


def prompt_tokens(tokenizer: Any, question: Question) -> tuple[int, ...]:
    """The question through the model's own chat template, as the API prompts it."""
    ids = tokenizer.apply_chat_template(question.messages, add_generation_prompt=True)
    return tuple(int(token) for token in ids)


def engine_request(tokenizer: Any, question: Question) -> GenerationRequest:
    """A greedy request for `question`, as the chat API builds it."""
    tokens = prompt_tokens(tokenizer, question)
    return GenerationRequest(f"real-{question.answer}", tokens, question.max_tokens)


def mlx_lm_greedy(
    model_dir: Path, questions: tuple[Question, ...], packed: bool = False
) -> list[Greedy]:
    """mlx-lm's own stream_generate on `model_dir`, greedy, one question at a time; `packed`:
    its quantized layers on tandem's CPU kernel, as the engines compute them."""
    from mlx_lm import load, stream_generate

    from engines.model.packed_quantized import pack

    model, tokenizer = load(str(model_dir))
    if packed:
        (model,) = pack(model)
    answers = []
    for question in questions:
        tokens, text, finish = [], "", ""
        prompt = list(prompt_tokens(tokenizer, question))
        for response in stream_generate(model, tokenizer, prompt, max_tokens=question.max_tokens):
            if response.finish_reason != "stop":  # "stop" comes with the EOS token
                tokens.append(int(response.token))
            text += response.text
            finish = response.finish_reason or finish
        answers.append(Greedy(tuple(tokens), text, finish))
    return answers
