"""Thawing a process a test may have frozen (SIGSTOP), when it may already be gone."""

from __future__ import annotations

import contextlib
import os
import signal


def wake(pid: int | None) -> None:
    """SIGCONT `pid`, unless it is gone: poll() can still say "running" while another thread
    is reaping it, so a test's clean-up must not fail on a process that just exited."""
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
