"""Progress bars (tqdm) for long waits, drawn only when stderr is a terminal."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

TICK_S = 0.1


def on_terminal() -> bool:
    return sys.stderr.isatty()


@contextmanager
def waiting(description: str, seconds: float | None = None) -> Iterator[None]:
    """A bar over `seconds` (or an elapsed-time counter when None) while the block runs."""
    if not on_terminal():
        yield
        return
    from tqdm import tqdm

    done = threading.Event()
    total = round(seconds, 1) if seconds else None
    unit_format = "{desc}: {bar} {n:.1f}/{total:.1f} s" if total else "{desc}: {n:.1f} s"
    bar = tqdm(total=total, desc=description, bar_format=unit_format, leave=False)

    def tick() -> None:
        began = time.monotonic()
        while not done.wait(TICK_S):
            elapsed = time.monotonic() - began
            bar.n = min(elapsed, total) if total else elapsed
            bar.refresh()

    ticker = threading.Thread(target=tick, name="progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()


@contextmanager
def steps(description: str, total: int) -> Iterator[Callable[[str], None] | None]:
    """A bar of `total` named steps; yields the callback to advance it (None off a terminal)."""
    if not on_terminal():
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=description, leave=False) as bar:

        def advance(step: str) -> None:
            bar.set_postfix_str(step)
            bar.update(1)

        yield advance


@contextmanager
def loading(description: str) -> Iterator[None]:
    """Elapsed time while an engine starts, and its layers loaded once it reports them
    (engines/observability/load_progress.py: the single engine does; tp ranks and pp stages
    load in their own processes and show elapsed time only)."""
    if not on_terminal():
        yield
        return
    from tqdm import tqdm

    from engines.observability.load_progress import listening

    lock = threading.Lock()
    bar = tqdm(total=None, desc=description, bar_format="{desc}: {elapsed}", leave=False)

    def advance(done: int, total: int) -> None:
        with lock:
            if bar.total != total:
                bar.total = total
                bar.bar_format = "{desc}: {bar} {n}/{total} layers, {elapsed}"
            bar.n = done
            bar.refresh()

    done = threading.Event()

    def tick() -> None:
        while not done.wait(TICK_S):
            with lock:
                bar.refresh()  # the elapsed time moves between layers too

    ticker = threading.Thread(target=tick, name="progress", daemon=True)
    ticker.start()
    try:
        with listening(advance):
            yield
    finally:
        done.set()
        ticker.join()
        bar.close()


@contextmanager
def counting(description: str, unit: str) -> Iterator[Callable[[int, int], None] | None]:
    """A bar that the yielded callback moves to (done, total) `unit`s (None off a terminal)."""
    if not on_terminal():
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=None, desc=description, unit=f" {unit}", leave=False) as bar:

        def advance(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

        yield advance
