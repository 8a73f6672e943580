"""Rank 0's reading of the engine's step commands: every inserted sequence is checked here,
grammar included, before any rank sees it, so that a bad one is refused for itself alone and
the ranks stay in step.
"""

from __future__ import annotations

from typing import Any

from engines.tensor_parallel.lockstep import STEP, Command, Insert
from engines.tensor_parallel.rank_grammar import RankGrammars
from planner.errors import EngineError


def parse_insert(
    message: Any, vocab_size: int | None, grammars: RankGrammars | None = None
) -> Insert:
    """Validate one inserted sequence before any rank sees it (a refusal keeps ranks in step).

    A grammar is compiled here, on rank 0, so one that fails is refused for its sequence
    instead of failing a rank after the broadcast.
    """
    if not isinstance(message, dict):
        raise ValueError("an insert must be a JSON object")
    prompt = message.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt must be a non-empty list of token ids")
    limit = vocab_size if isinstance(vocab_size, int) else 2**31
    if not all(isinstance(token, int) and 0 <= token < limit for token in prompt):
        raise ValueError(f"prompt token ids must be integers in [0, {limit})")
    max_tokens = message.get("max_tokens")
    if not isinstance(max_tokens, int) or not 1 <= max_tokens < 2**31:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    temperature = float(message.get("temperature", 0.0))
    top_p = float(message.get("top_p", 1.0))
    seed = message.get("seed", 0)
    if temperature < 0 or not 0 <= top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 <= top_p <= 1, got {temperature}, {top_p}")
    if not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    penalties = [
        float(message.get(name) or 0.0)
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")
    ]
    if penalties[0] < 0:
        raise ValueError(f"repetition_penalty must be >= 0, got {penalties[0]}")
    logprobs = message.get("logprobs")
    logprobs = -1 if logprobs is None else logprobs
    if not isinstance(logprobs, int) or not -1 <= logprobs <= 20:
        raise ValueError(f"logprobs must be an integer in [0, 20] or null, got {logprobs!r}")
    entry, cached = message.get("entry", -1), message.get("cached", 0)
    if not isinstance(entry, int) or not isinstance(cached, int) or not -1 <= entry < 2**31:
        raise ValueError(f"entry and cached must be integers, got {entry!r}, {cached!r}")
    if (entry >= 0) != (cached > 0) or not 0 <= cached < 2**31:
        raise ValueError(
            f"a prefix-cache start needs an entry and cached > 0, got {entry}, {cached}"
        )
    grammar = message.get("grammar")
    if grammar is not None:
        check_grammar(grammar, grammars)
    return Insert(
        message["uid"],
        tuple(prompt),
        max_tokens,
        seed,
        temperature,
        top_p,
        *penalties,
        logprobs,
        entry,
        cached,
        grammar,
    )


def check_grammar(grammar: Any, grammars: RankGrammars | None) -> None:
    """ValueError unless `grammar` is text that compiles against this model's tokenizer."""
    if not isinstance(grammar, str) or not grammar:
        raise ValueError("grammar must be a non-empty string or null")
    grammar.encode()  # a lone surrogate cannot cross the lockstep: UnicodeEncodeError
    if grammars is None:
        raise ValueError("this rank has no grammar compiler")
    try:
        grammars.processor(grammar)
    except (EngineError, RuntimeError) as error:  # llguidance raises RuntimeError on some input
        raise ValueError(str(error)) from None


def parse_step(
    message: dict[str, Any], vocab_size: int | None, grammars: RankGrammars | None = None
) -> tuple[Command, list[tuple[Any, str]]]:
    """A step command from the engine, and the inserts refused with their reasons."""
    removes = message.get("remove", [])
    if not isinstance(removes, list) or not all(
        isinstance(uid, int) and 0 <= uid < 2**31 for uid in removes
    ):
        raise ValueError("remove must be a list of uids (integers in [0, 2**31))")
    inserts, refused = [], []
    for entry in message.get("insert", []):
        uid = entry.get("uid") if isinstance(entry, dict) else None
        if not isinstance(uid, int) or not 0 <= uid < 2**31:
            raise ValueError(f"an insert needs a uid in [0, 2**31), got {uid!r}")
        try:
            inserts.append(parse_insert(entry, vocab_size, grammars))
        except (TypeError, ValueError) as error:
            refused.append((uid, str(error)))
    evicts, spills = _entry_ids(message, "evict"), _entry_ids(message, "spill")
    advance = bool(message.get("advance", True))
    command = Command(STEP, tuple(inserts), tuple(removes), evicts, advance, spills=spills)
    return command, refused


def _entry_ids(message: dict[str, Any], name: str) -> tuple[int, ...]:
    ids = message.get(name, [])
    if not isinstance(ids, list) or not all(
        isinstance(entry, int) and 0 <= entry < 2**31 for entry in ids
    ):
        raise ValueError(f"{name} must be a list of prefix-cache entry ids")
    return tuple(ids)
