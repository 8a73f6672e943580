"""When a prefix-cache disk hit pays: reading an entry of L tokens back from disk against
prefilling the tokens it saves, on the single engine (the read is the same on every node).

Run from the project root: `python -m tests.bench.bench_disk_hit` (a few minutes). For each
demo model and entry length: the median first-token time of a fresh L-token prompt (its
prefill), and the median time `PrefixStore.load` takes to read an entry of L tokens back from
its file (the digest checked, as every read is). The read's cost in prefilled tokens is the
shortest shared prefix a disk hit must cover to pay (`MIN_DISK_HIT_TOKENS` in
engines/prefix_cache/index.py). Writes "## Prefix cache: when a disk hit pays".
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

from engines.core.engine_options import EngineOptions
from engines.core.request import GenerationRequest
from engines.prefix_cache.index import MIN_DISK_HIT_TOKENS
from engines.single.engine import SingleEngine
from tests.bench.common import describe_machine, markdown_table, write_section
from tests.helpers.demo_models import make_demo_model

MODELS = ((4, 256), (8, 512))  # (layers, hidden)
LENGTHS = (256, 1024, 4096)
REPEATS = 3
VOCABULARY = range(10, 500)


class Timer:
    """A single engine whose every entry goes to disk (a 1-byte memory tier)."""

    def __init__(self, model: Path, root: Path) -> None:
        self.engine = SingleEngine(
            model,
            EngineOptions(
                prefix_cache_bytes=1, prefix_cache_disk_bytes=8 << 30, prefix_cache_dir=str(root)
            ),
        )
        self.engine.load()
        self.uid = 0

    def first_token(self, prompt: list[int]) -> tuple[float, int]:
        """(seconds to the first token, the uid whose entry it leaves)."""
        self.uid += 1
        started = time.perf_counter()
        self.engine.insert(self.uid, GenerationRequest(f"r{self.uid}", tuple(prompt), 4))
        while not any(output.uid == self.uid for output in self.engine.step()):
            pass
        took = time.perf_counter() - started
        self.engine.remove([self.uid])
        return took, self.uid

    def read(self, length: int) -> float:
        """Seconds to read an entry of `length` tokens back from its file."""
        _, entry = self.first_token(fresh(length))
        store = self.engine.prefix_store
        store.spill(self.engine.prefix_index.take_spills())
        time.sleep(0.5 + length / 2000)  # written in the background
        started = time.perf_counter()
        store.load(entry)
        took = time.perf_counter() - started
        store.drop([entry])
        return took

    def close(self) -> None:
        self.engine.close()


def fresh(length: int) -> list[int]:
    return [random.choice(VOCABULARY) for _ in range(length)]


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-disk-hit-") as scratch:
        for layers, hidden in MODELS:
            model = make_demo_model(Path(scratch) / "models", layers=layers, hidden=hidden)
            timer = Timer(model, Path(scratch) / f"cache-{layers}-{hidden}")
            for _ in range(3):
                timer.first_token(fresh(64))  # warm-up
            for length in LENGTHS:
                prefill = statistics.median(
                    timer.first_token(fresh(length))[0] for _ in range(REPEATS)
                )
                read = statistics.median(timer.read(length) for _ in range(REPEATS))
                per_token = prefill / length
                rows.append([
                    f"{layers}-layer hidden-{hidden}", str(length), f"{prefill * 1000:.0f} ms",
                    f"{per_token * 1e6:.0f} us", f"{read * 1000:.1f} ms", f"{read / per_token:.0f}",
                ])  # fmt: skip
                print(rows[-1], flush=True)
            timer.close()
    table = markdown_table(
        ["model", "entry tokens", "prefill", "a token", "disk read", "read = prefill of (tokens)"],
        rows,
    )
    body = (
        "`python -m tests.bench.bench_disk_hit`. A disk hit reads its whole entry back; the "
        "read's cost in prefilled tokens is the shortest shared prefix worth reading. "
        f"`MIN_DISK_HIT_TOKENS` is {MIN_DISK_HIT_TOKENS}.\n\n"
        f"{describe_machine()}\n\n{table}\n"
    )
    write_section("## Prefix cache: when a disk hit pays", body)


if __name__ == "__main__":
    main()
