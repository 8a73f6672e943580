"""Rank 0's reading of the engine's step commands: every inserted sequence is checked here,
grammar included, before any rank sees it, so that a bad one is refused for itself alone and
the ranks stay in step.
"""

from __future__ import annotations

from typing import Any

from engines.core.request import MAX_TOKEN_ID, GenerationRequest
from engines.tensor_parallel.lockstep import STEP, Command, Insert
from engines.tensor_parallel.rank_grammar import RankGrammars
from errors import EngineError, RequestError


def parse_insert(
    message: Any, vocab_size: int | None, grammars: RankGrammars | None = None
) -> Insert:
    """Validate one inserted sequence before any rank sees it (a refusal keeps ranks in step).

    Its request is checked as every request is (GenerationRequest.check); here its prompt (the
    whole prompt, of which the first `cached` tokens come from prefix-cache entry `entry`) is
    checked against the model's vocabulary, its seed must be set (every rank samples with it),
    and a grammar is compiled, on rank 0, so one that fails is refused for its sequence instead
    of failing a rank after the broadcast.
    """
    if not isinstance(message, dict):
        raise ValueError("an insert must be a JSON object")
    try:
        request = GenerationRequest.from_document(message.get("request"))
    except RequestError as error:
        raise ValueError(str(error)) from None
    limit = vocab_size if isinstance(vocab_size, int) else MAX_TOKEN_ID + 1
    if not all(token < limit for token in request.prompt_tokens):
        raise ValueError(f"prompt token ids must be integers in [0, {limit})")
    if request.seed is None:
        raise ValueError("an insert's seed must be set: every rank samples with it")
    entry, cached = message.get("entry", -1), message.get("cached", 0)
    if not isinstance(entry, int) or not isinstance(cached, int) or not -1 <= entry < 2**31:
        raise ValueError(f"entry and cached must be integers, got {entry!r}, {cached!r}")
    if (entry >= 0) != (cached > 0) or not 0 <= cached < len(request.prompt_tokens):
        raise ValueError(
            f"a prefix-cache start needs an entry and 0 < cached < the prompt's "
            f"{len(request.prompt_tokens)} tokens, got {entry}, {cached}"
        )
    if request.grammar is not None:
        check_grammar(request.grammar, grammars)
    return Insert(message["uid"], request, entry, cached)


def check_grammar(grammar: str, grammars: RankGrammars | None) -> None:
    """ValueError unless `grammar` compiles against this model's tokenizer."""
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
    if not isinstance(removes, list) or not all(_is_id(uid) for uid in removes):
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
    keeps = message.get("keep", [])
    if not isinstance(keeps, list) or not all(
        isinstance(pair, list) and len(pair) == 2 and all(_is_id(value) for value in pair)
        for pair in keeps
    ):
        raise ValueError("keep must be a list of [uid, entry id] pairs")
    advance = bool(message.get("advance", True))
    command = Command(
        STEP, tuple(inserts), tuple(removes), evicts, advance, spills=spills,
        keeps=tuple((uid, entry) for uid, entry in keeps),
    )  # fmt: skip
    return command, refused


def _is_id(value: Any) -> bool:
    """A uid or an entry id: an integer in [0, 2**31) (one int32 word on the wire)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def _entry_ids(message: dict[str, Any], name: str) -> tuple[int, ...]:
    ids = message.get(name, [])
    if not isinstance(ids, list) or not all(_is_id(entry) for entry in ids):
        raise ValueError(f"{name} must be a list of prefix-cache entry ids")
    return tuple(ids)
