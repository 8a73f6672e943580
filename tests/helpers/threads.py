"""Run one side of a two-party exchange (a handshake, a dial) in a thread within a test."""

from __future__ import annotations

import threading
from collections.abc import Callable

JOIN_TIMEOUT_S = 10.0


def run_in_thread(
    function: Callable[[], object], timeout_s: float = JOIN_TIMEOUT_S
) -> Callable[[], object]:
    """Start `function` in a thread; the returned callable joins and returns or re-raises."""
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = function()
        except BaseException as error:  # handed back to the test thread
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()

    def join() -> object:
        thread.join(timeout_s)
        assert not thread.is_alive(), "the thread did not finish"
        if "error" in outcome:
            raise outcome["error"]  # type: ignore[misc]
        return outcome["value"]

    return join
