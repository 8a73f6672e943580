"""Shared benchmark helpers: interleaved rounds, medians, markdown tables, docs sections."""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from discovery.framing import free_port  # noqa: F401 (re-exported for the benchmarks)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS_DOC = PROJECT_ROOT / "docs" / "benchmarks.md"
TITLE = "# Benchmarks"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed generation: time to first token, decode rate after it, tokens seen."""

    first_token_s: float
    decode_tokens_per_s: float
    tokens: int
    cpu_s: float | None = None  # CPU time of this process and the servers it talks to


def sample_from_stamps(started: float, first: float, last: float, tokens: int) -> Sample:
    """Decode rate counts the tokens after the first over the time after the first."""
    if tokens < 2 or last <= first:
        raise ValueError(f"need at least 2 tokens over a positive time, got {tokens} tokens")
    return Sample(first - started, (tokens - 1) / (last - first), tokens)


def cpu_seconds(pids: Sequence[int] = ()) -> float | None:
    """CPU time (user + system) of this process plus `pids`; None where /proc is missing."""
    total = time.process_time()
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces
        total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
    return total


def with_cpu(measure: Callable[[], Sample], pids: Sequence[int] = ()) -> Callable[[], Sample]:
    """`measure`, with the CPU time it cost here and in `pids` recorded on its Sample."""

    def measured() -> Sample:
        before = cpu_seconds(pids)
        sample = measure()
        after = cpu_seconds(pids)
        if before is None or after is None:
            return sample
        return dataclasses.replace(sample, cpu_s=after - before)

    return measured


def run_interleaved(
    contenders: Mapping[str, Callable[[], Sample]], rounds: int, warmups: int = 1
) -> dict[str, list[Sample]]:
    """Warm every contender up, then time them in rounds, every contender once per round.

    Each round starts one contender later (A B C, B C A, C A B, ...) so drift and whatever
    a run leaves behind (a server still tidying up) fall on every contender alike.
    """
    names = list(contenders)
    for _ in range(warmups):
        for measure in contenders.values():
            measure()
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            samples[name].append(contenders[name]())
    return samples


def median_of(samples: Sequence[Sample], field: Callable[[Sample], float]) -> float:
    return statistics.median(field(sample) for sample in samples)


def cpu_ms_per_token(samples: Sequence[Sample]) -> str:
    """The median CPU milliseconds per generated token, or "n/a" when it was not measured."""
    if any(sample.cpu_s is None for sample in samples):
        return "n/a"
    return f"{median_of(samples, lambda s: s.cpu_s / s.tokens) * 1e3:.2f}"


def counts_between(
    first: Mapping[str, Any], last: Mapping[str, Any]
) -> dict[str, dict[str, float]]:
    """{name: {"count", "sum"}} totals that grew from `first` to `last` (two snapshots of
    StepTimes' segments or one_row): what the steps between them added."""
    delta = {}
    for name, totals in last.items():
        old = first.get(name, {"count": 0, "sum": 0.0})
        delta[name] = {"count": totals["count"] - old["count"], "sum": totals["sum"] - old["sum"]}
    return delta


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table; every column after the first is right-aligned (they hold numbers)."""
    align = ["---"] + ["---:"] * (len(header) - 1)
    lines = [header, align, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"


def describe_machine() -> str:
    """One line about where the numbers come from."""
    import mlx.core as mx

    return (
        f"Machine: {os.cpu_count()} cores, {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}, mlx {mx.__version__} on {mx.default_device()} "
        "(CPU-only mlx: absolute numbers are far below Apple silicon; compare ratios)."
    )


def write_section(heading: str, body: str, path: Path = BENCHMARKS_DOC) -> None:
    """Replace (or append) one `## ` section of the benchmarks doc; others stay as they are.

    A new doc, or one whose top holds only the title, gets the machine description there.
    """
    text = path.read_text() if path.exists() else TITLE + "\n"
    top_end = text.find("\n## ")
    top = text if top_end < 0 else text[:top_end]
    if top.strip() == TITLE:
        text = f"{TITLE}\n\n{describe_machine()}\n" + ("" if top_end < 0 else text[top_end:])
    section = f"{heading}\n\n{body.rstrip()}\n"
    start = text.find(f"\n{heading}\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + 1)
        text = text[: start + 1] + section + ("" if end < 0 else text[end:])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def stream_alone(engine: Any, request: Any) -> Iterator[int]:
    """One request on a bare engine (no scheduler), stepped until max_tokens: its tokens."""
    engine.insert(0, request)
    produced = 0
    try:
        while produced < request.max_tokens:
            for output in engine.step():
                if output.error is not None:
                    raise RuntimeError(f"the engine refused the request: {output.error}")
                produced += 1
                yield output.token
    finally:
        engine.remove([0])
