"""What a pipeline frame's documents say about a sequence: the BEGIN's request (its
GenerationRequest's document) and prefix-cache entry, the END's keep, share, evict and spill
orders, and what a STATUS roll call asks of every stage's disk tier: entries to read back, or
files to adopt when a session starts (chain_disk.py). The bytes
around them are the wire's (wire.py); this module checks their meaning, so that a stage
refuses a malformed document before it touches a cache or a sampler.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engines.core.request import GenerationRequest
from engines.pipeline.wire import Frame, Kind, Row, WireError, document_frame
from errors import RequestError

MAX_UID = 2**64 - 1  # a row's uid field; prefix-cache entry ids are uids
MAX_POSITION = 2**32 - 1  # a row's position field
MAX_EVICT_PER_END = 1000  # entry ids per END list (or STATUS load): far below MAX_JSON_BYTES
PENALTY_CONTEXT = 20  # prompt tokens a BEGIN's request carries for the penalties (mlx-lm's)
PREFIX_ENTRY = "prefix_entry"  # a BEGIN document's one key that is the wire's, not the request's
DISK_NAME = re.compile(r"[0-9a-f]{1,64}")  # a disk roll call's session name and file keys


def end_frame(
    number: int,
    uids: Sequence[int],
    keep: Sequence[tuple[int, int]] = (),
    evict: Sequence[int] = (),
    spill: Sequence[int] = (),
    share: Sequence[tuple[int, int, int]] = (),
) -> Frame:
    """Free `uids`' caches, first keeping `keep` ((uid, tokens) of them) as prefix-cache
    entries named by their uid and `share` ((uid, entry, tokens) of running sequences) as
    entries `entry`; then drop the entries `evict` and move `spill` to disk."""
    orders = EndOrders(tuple(keep), tuple(evict), tuple(spill), tuple(share))
    return document_frame(Kind.END, number, orders.document(), [Row(uid, 0) for uid in uids])


def begin_request(document: dict[str, Any]) -> GenerationRequest:
    """The request a BEGIN document carries, as the last stage samples it: its prompt is the
    tail the penalties look at, and its seed is set. WireError when it is not one."""
    fields = {name: value for name, value in document.items() if name != PREFIX_ENTRY}
    try:
        request = GenerationRequest.from_document(fields)
    except RequestError as error:
        raise WireError(f"malformed BEGIN document: {error}") from None
    if request.seed is None:
        raise WireError("malformed BEGIN document: its seed is not set")
    if len(request.prompt_tokens) > PENALTY_CONTEXT:
        raise WireError(
            f"malformed BEGIN document: {len(request.prompt_tokens)} prompt tokens, more than "
            f"the penalties' {PENALTY_CONTEXT}"
        )
    return request


def prefix_entry_of(document: dict[str, Any]) -> int | None:
    """The prefix-cache entry a BEGIN document starts its sequence from, or None (empty caches).

    The BEGIN row's position says how many of the entry's tokens it takes."""
    entry = document.get(PREFIX_ENTRY)
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
    `share`: (uid, entry, tokens) of sequences still running (not rows) whose prompt was just
    prefilled: their caches' first `tokens` become entry `entry`, for the requests that waited
    for that prompt (shared prefill). `evict`: entries every stage drops, after keeping.
    `spill`: entries every stage moves from memory to its disk tier (or drops, without one),
    last.
    """

    keep: tuple[tuple[int, int], ...] = ()
    evict: tuple[int, ...] = ()
    spill: tuple[int, ...] = ()
    share: tuple[tuple[int, int, int], ...] = ()

    def document(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "keep": [[uid, tokens] for uid, tokens in self.keep],
            "evict": list(self.evict),
        }
        if self.spill:
            document["spill"] = list(self.spill)
        if self.share:
            document["share"] = [list(item) for item in self.share]
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
        return cls(tuple(pairs), evict, spill, _share_orders(document.get("share", []), rows))


def _share_orders(value: Any, rows: set[int]) -> tuple[tuple[int, int, int], ...]:
    """An END's `share` list: (uid, entry, tokens) of sequences the frame does not end."""
    if not isinstance(value, list) or len(value) > MAX_EVICT_PER_END:
        raise WireError(f"END share must be a list of at most {MAX_EVICT_PER_END} items")
    orders = []
    for item in value:
        if not (
            isinstance(item, list)
            and len(item) == 3
            and _is_count(item[0], MAX_UID)
            and _is_count(item[1], MAX_UID)
            and _is_count(item[2], MAX_POSITION)
            and item[2] > 0
        ):
            raise WireError(f"END document: malformed share item {str(item)[:40]}")
        if item[0] in rows:
            raise WireError(f"END shares the prompt of sequence {item[0]}, which it ends")
        orders.append((item[0], item[1], item[2]))
    if len({entry for _, entry, _ in orders}) != len(orders):
        raise WireError("END document shares two prompts as one entry")
    return tuple(orders)


def load_orders_of(document: dict[str, Any]) -> tuple[int, ...]:
    """The prefix-cache entries a STATUS roll call asks every stage to read back from disk
    (each stage reports those it could not: `unreadable`); WireError when malformed."""
    return _entry_ids(document.get("load", []), "STATUS load")


@dataclass(frozen=True, slots=True)
class DiskRollCall:
    """A STATUS roll call's `disk` order, when a session starts (chain_disk.py): name new
    files by `session`; adopt the files named `key` as entries `entry`; when `complete`,
    remove every file not adopted. Every stage reports the entries whose files it lacks."""

    session: str
    adopt: tuple[tuple[int, str], ...] = ()
    complete: bool = True

    def document(self) -> dict[str, Any]:
        pairs = [[entry, key] for entry, key in self.adopt]
        return {"session": self.session, "adopt": pairs, "complete": self.complete}


def disk_roll_call_of(document: dict[str, Any]) -> DiskRollCall | None:
    """A STATUS document's `disk` order, or None; WireError when malformed."""
    order = document.get("disk")
    if order is None:
        return None
    if not isinstance(order, dict):
        raise WireError("STATUS disk must be an object")
    session, adopt, complete = order.get("session"), order.get("adopt"), order.get("complete")
    if not (isinstance(session, str) and DISK_NAME.fullmatch(session)):
        raise WireError(f"STATUS disk session {str(session)[:40]!r} is not a name")
    if not isinstance(complete, bool):
        raise WireError("STATUS disk complete must be true or false")
    if not isinstance(adopt, list) or len(adopt) > MAX_EVICT_PER_END:
        raise WireError(f"STATUS disk adopt must be a list of at most {MAX_EVICT_PER_END} items")
    pairs = []
    for item in adopt:
        if not (
            isinstance(item, list)
            and len(item) == 2
            and _is_count(item[0], MAX_UID)
            and isinstance(item[1], str)
            and DISK_NAME.fullmatch(item[1])
        ):
            raise WireError(f"STATUS disk: malformed adopt item {str(item)[:40]}")
        pairs.append((item[0], item[1]))
    return DiskRollCall(session, tuple(pairs), complete)


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
