"""What a pipeline frame's documents say about a sequence: the BEGIN's sampling, penalties,
logprobs, grammar and prefix-cache entry, the END's keep, evict and spill orders, and the
prefix-cache entries a STATUS roll call asks every stage to read back from disk. The bytes around
them are the wire's (wire.py); this module bounds and checks their meaning, so that a stage
refuses a malformed document before it touches a cache or a sampler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engines.pipeline.wire import (
    MAX_JSON_BYTES,
    MAX_TOP_LOGPROBS,
    Frame,
    Kind,
    Row,
    WireError,
    document_frame,
)

MAX_SEED = 2**64 - 1  # mlx seeds are unsigned 64-bit
MAX_TEMPERATURE = 100.0
MAX_LABEL_CHARS = 128
MAX_UID = 2**64 - 1  # a row's uid field; prefix-cache entry ids are uids
MAX_POSITION = 2**32 - 1  # a row's position field
MAX_EVICT_PER_END = 1000  # entry ids per END list (or STATUS load): far below MAX_JSON_BYTES
MAX_PENALTY = 100.0
PENALTY_CONTEXT = 20  # prompt tokens a BEGIN carries for the penalties (mlx-lm's window)
MAX_GRAMMAR_CHARS = MAX_JSON_BYTES  # a BEGIN's grammar: the whole document bounds it anyway


def end_frame(
    number: int,
    uids: Sequence[int],
    keep: Sequence[tuple[int, int]] = (),
    evict: Sequence[int] = (),
    spill: Sequence[int] = (),
) -> Frame:
    """Free `uids`' caches, first keeping `keep` ((uid, tokens) of them) as prefix-cache
    entries named by their uid; then drop the entries `evict` and move `spill` to disk."""
    orders = EndOrders(tuple(keep), tuple(evict), tuple(spill))
    return document_frame(Kind.END, number, orders.document(), [Row(uid, 0) for uid in uids])


@dataclass(frozen=True, slots=True)
class Sampling:
    """What a BEGIN frame tells the last stage: how to sample, and a label for its logs."""

    temperature: float
    top_p: float
    seed: int
    label: str = ""
    # mlx-lm's logits processors (None / 0 = off) and the prompt's last tokens they look at
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    context: tuple[int, ...] = ()
    logprobs: int | None = None  # None: off; k: the token's logprob and the top k
    grammar: str | None = None  # an llguidance grammar the output must match (decoding/grammar.py)

    def document(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "id": self.label[:MAX_LABEL_CHARS],
        }
        if self.penalised:
            document["penalties"] = [
                self.repetition_penalty or 0.0,
                self.presence_penalty,
                self.frequency_penalty,
            ]
            document["context"] = list(self.context[-PENALTY_CONTEXT:])
        if self.logprobs is not None:
            document["logprobs"] = self.logprobs
        if self.grammar is not None:
            document["grammar"] = self.grammar
        return document

    @property
    def scored(self) -> bool:
        """Whether the last stage does more than sample: processors, logprobs or a grammar."""
        return self.penalised or self.logprobs is not None or self.grammar is not None

    @property
    def penalised(self) -> bool:
        return bool(self.repetition_penalty or self.presence_penalty or self.frequency_penalty)

    @classmethod
    def of(cls, document: dict[str, Any]) -> Sampling:
        """Validate a BEGIN document (WireError when a field is missing or out of range)."""
        try:
            temperature = float(document["temperature"])
            top_p = float(document["top_p"])
            seed = document["seed"]
            label = str(document.get("id", ""))[:MAX_LABEL_CHARS]
        except (KeyError, TypeError, ValueError) as error:
            raise WireError(f"malformed BEGIN document: missing or bad {error}") from None
        if not (isinstance(seed, int) and 0 <= seed <= MAX_SEED):
            raise WireError(f"BEGIN seed {seed!r} is not an integer in [0, {MAX_SEED}]")
        if not (0.0 <= temperature <= MAX_TEMPERATURE and 0.0 <= top_p <= 1.0):
            raise WireError(f"BEGIN temperature {temperature} or top_p {top_p} is out of range")
        penalties = document.get("penalties", [0.0, 0.0, 0.0])
        context = document.get("context", [])
        logprobs = document.get("logprobs")
        grammar = document.get("grammar")
        if not (
            isinstance(penalties, list)
            and len(penalties) == 3
            and all(
                isinstance(value, int | float) and not isinstance(value, bool)
                for value in penalties
            )
            and 0.0 <= penalties[0] <= MAX_PENALTY
            and all(math.isfinite(value) and abs(value) <= MAX_PENALTY for value in penalties)
        ):
            raise WireError(f"BEGIN penalties {penalties!r} are not three numbers in range")
        if not (
            isinstance(context, list)
            and len(context) <= PENALTY_CONTEXT
            and all(isinstance(token, int) and 0 <= token < 2**32 for token in context)
        ):
            raise WireError(f"BEGIN context is not a list of at most {PENALTY_CONTEXT} token ids")
        if logprobs is not None and not (
            isinstance(logprobs, int) and 0 <= logprobs <= MAX_TOP_LOGPROBS
        ):
            raise WireError(f"BEGIN logprobs {logprobs!r} is not an integer in [0, 20]")
        if grammar is not None and not (
            isinstance(grammar, str) and 0 < len(grammar) <= MAX_GRAMMAR_CHARS
        ):
            raise WireError(
                f"BEGIN grammar {str(grammar)[:40]!r} is not a text of 1 to "
                f"{MAX_GRAMMAR_CHARS} characters"
            )
        repetition, presence, frequency = (float(value) for value in penalties)
        return cls(
            temperature,
            top_p,
            seed,
            label,
            repetition or None,
            presence,
            frequency,
            tuple(context),
            logprobs,
            grammar,
        )


def prefix_entry_of(document: dict[str, Any]) -> int | None:
    """The prefix-cache entry a BEGIN document starts its sequence from, or None (empty caches).

    The BEGIN row's position says how many of the entry's tokens it takes."""
    entry = document.get("prefix_entry")
    if entry is None:
        return None
    if not _is_count(entry, MAX_UID):
        raise WireError(f"BEGIN prefix_entry {str(entry)[:40]!r} is not an entry id")
    return entry


@dataclass(frozen=True, slots=True)
class EndOrders:
    """What an END frame asks besides freeing its rows' caches.

    `keep`: (uid, tokens) of ended rows whose caches become prefix-cache entries named by the
    uid; `tokens` is the sequence's cache length, which every stage checks against its own.
    `evict`: entries every stage drops, after keeping. `spill`: entries every stage moves
    from memory to its disk tier (or drops, without one), last.
    """

    keep: tuple[tuple[int, int], ...] = ()
    evict: tuple[int, ...] = ()
    spill: tuple[int, ...] = ()

    def document(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "keep": [[uid, tokens] for uid, tokens in self.keep],
            "evict": list(self.evict),
        }
        if self.spill:
            document["spill"] = list(self.spill)
        return document

    @classmethod
    def of(cls, frame: Frame) -> EndOrders:
        """Validate an END frame's document against its rows (WireError when malformed)."""
        document = frame.document()
        keep, evict = document.get("keep", []), document.get("evict", [])
        if not isinstance(keep, list):
            raise WireError("END document: keep must be a list")
        evict, spill = (
            _entry_ids(evict, "END evict"),
            _entry_ids(document.get("spill", []), "END spill"),
        )
        rows = set(frame.uids)
        pairs = []
        for item in keep:
            if not (
                isinstance(item, list)
                and len(item) == 2
                and _is_count(item[0], MAX_UID)
                and _is_count(item[1], MAX_POSITION)
                and item[1] > 0
            ):
                raise WireError(f"END document: malformed keep item {str(item)[:40]}")
            if item[0] not in rows:
                raise WireError(f"END keeps sequence {item[0]}, which the frame does not end")
            pairs.append((item[0], item[1]))
        if len({uid for uid, _ in pairs}) != len(pairs):
            raise WireError("END document keeps a sequence twice")
        return cls(tuple(pairs), evict, spill)


def load_orders_of(document: dict[str, Any]) -> tuple[int, ...]:
    """The prefix-cache entries a STATUS roll call asks every stage to read back from disk
    (each stage reports those it could not: `unreadable`); WireError when malformed."""
    return _entry_ids(document.get("load", []), "STATUS load")


def _entry_ids(value: Any, name: str) -> tuple[int, ...]:
    """A bounded list of prefix-cache entry ids."""
    if not isinstance(value, list) or len(value) > MAX_EVICT_PER_END:
        raise WireError(f"{name} must be a list of at most {MAX_EVICT_PER_END} entry ids")
    if not all(_is_count(entry, MAX_UID) for entry in value):
        raise WireError(f"{name} must list entry ids")
    return tuple(value)


def _is_count(value: Any, maximum: int) -> bool:
    """An integer in [0, maximum] (JSON true / false are not)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= maximum
