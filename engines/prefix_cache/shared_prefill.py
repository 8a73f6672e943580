"""PrefillSharing: a request that shares a long prefix with a prompt still being prefilled
waits for that prompt's KV instead of computing the same tokens again.

Eight users who open a conversation with one long system prompt at once would otherwise all
miss the prefix cache: no entry exists until a prompt finishes. The engine admits the first
(the owner) as usual and holds the others back; once the owner's prompt is prefilled (its
first token came out), the engine keeps the owner's prompt KV as a prefix-cache entry and
lets the waiting requests in, which then start from it. The wait is bounded: a waiter goes
in anyway after `max_wait_s`, or at once when its owner leaves the batch.

This module only keeps the books (pure, no mlx); the engine does the inserting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engines.prefix_cache.index import PrefixIndex, common_prefix

MIN_SHARED_TOKENS = 64  # shorter common prefixes are cheaper to recompute than to wait for
MAX_WAIT_S = 10.0


@dataclass(slots=True)
class _Waiter:
    request: Any
    owner: int
    deadline: float


class PrefillSharing:
    """Prompts being prefilled (by uid) and the requests waiting for one of them."""

    def __init__(
        self, min_shared_tokens: int = MIN_SHARED_TOKENS, max_wait_s: float = MAX_WAIT_S
    ) -> None:
        self.min_shared_tokens = min_shared_tokens
        self.max_wait_s = max_wait_s
        self._prefilling: dict[int, tuple[int, ...]] = {}  # uid -> its prompt
        self._waiters: dict[int, _Waiter] = {}  # uid -> what it waits for
        self.shared = 0  # requests that waited and were let in (for the snapshot)

    def __contains__(self, uid: int) -> bool:
        """Whether `uid` is waiting (not in the batch yet)."""
        return uid in self._waiters

    def prefilling(self, uid: int, prompt: tuple[int, ...]) -> None:
        """`uid` entered the batch; its prompt is prefilled over the next steps."""
        self._prefilling[uid] = prompt

    def owner_for(self, prompt: tuple[int, ...], covered: int) -> int | None:
        """The prefilling sequence whose prompt shares the longest prefix with `prompt`, when
        that prefix beats what the prefix cache already `covered` by enough to wait for."""
        best, best_shared = None, covered + self.min_shared_tokens - 1
        for uid, other in self._prefilling.items():
            shared = min(common_prefix(other, prompt), len(prompt) - 1)
            if shared > best_shared and uid not in self._waiters:
                best, best_shared = uid, shared
        return best

    def hold(self, uid: int, request: Any, index: PrefixIndex) -> bool:
        """Make `uid` wait when a prompt being prefilled shares enough more of its prompt than
        `index`'s entries cover; True when it now waits (the engine inserts it later)."""
        if not index.enabled:
            return False
        prompt = tuple(request.prompt_tokens)
        covered = index.peek(prompt)
        owner = self.owner_for(prompt, covered.tokens if covered else 0)
        if owner is not None:
            self.wait(uid, request, owner)
        return owner is not None

    def wait(self, uid: int, request: Any, owner: int) -> None:
        self._waiters[uid] = _Waiter(request, owner, time.monotonic() + self.max_wait_s)

    def first_token(self, uid: int) -> bool:
        """`uid` produced its first token: its prompt is done. True when requests wait for
        it (the engine should now keep its prompt's KV)."""
        if self._prefilling.pop(uid, None) is None:
            return False
        return any(waiter.owner == uid for waiter in self._waiters.values())

    def released(self, owners_done: set[int] | None = None) -> list[tuple[int, Any]]:
        """The waiters to let in now: their owner is done (`owners_done`) or gone from the
        batch, or they waited `max_wait_s`. Each is returned once."""
        now, owners_done = time.monotonic(), owners_done or set()
        ready = [
            uid
            for uid, waiter in self._waiters.items()
            if waiter.owner in owners_done
            or waiter.owner not in self._prefilling
            or now >= waiter.deadline
        ]
        self.shared += len(ready)
        return [(uid, self._waiters.pop(uid).request) for uid in ready]

    def forget(self, uids: Any) -> None:
        """Sequences removed from the batch (finished, cancelled) or never let in."""
        for uid in uids:
            self._prefilling.pop(uid, None)
            self._waiters.pop(uid, None)

    def clear(self) -> None:
        self._prefilling.clear()
        self._waiters.clear()
