"""Draft-model speculation (--draft-model) against mlx_lm.server --draft-model, the same pair on
the same BLAS: one greedy stream's decode tok/s over HTTP, side by side in interleaved rounds.

The only real model here is SmolLM2-135M-Instruct, so each pair is one model twice (it accepts
optimistically): its Q4_1 import (mlx 4-bit) drafting for a float16 copy, and for its float32
import. On this CPU mlx's float16 and 4-bit matmuls have no BLAS path: a float16 pass costs
about twice a 4-bit one, which costs about four float32 ones. mlx_lm.server computes the float16
copy in float16, where drafting pays; tandem computes float16 weights in float32 on the CPU
(engines/model/precision.py), where a 4-bit draft loses, as it does for the float32 import: there
tandem's drafter steps aside (engines/speculation/payoff.py). tandem without speculation is the
third contender of each pair; tandem's drafted and accepted tokens are read from its /metrics.

A last table compares the drafting itself, in one process and without HTTP: tandem's lane with
a draft model that always drafts (the clock's verdict left out) against mlx-lm's
`speculative_generate_step`, the float32 pair, greedy.

Run from the project root: `python -m tests.bench.bench_draft_model` (about 15 minutes;
`--drafting-only`: the last table alone, printed). It writes docs/benchmarks.md's
"## Draft-model speculation" section.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import httpx

from discovery.framing import free_port
from engines.core.blas import activate
from engines.decoding.decode_batch import DecodeBatch
from engines.decoding.sampling import greedy
from engines.model.gguf.cache import ensure_imported
from engines.speculation.draft_model import DraftModelDrafter
from tests.bench.bench_single import HOST, ServerProcess, tandem_command, time_stream
from tests.bench.common import Sample, markdown_table, run_interleaved, write_section
from tests.helpers.real_models import smollm2_gguf

HEADING = "## Draft-model speculation"
COMMAND = "python -m tests.bench.bench_draft_model"
DRAFTED = 3  # mlx_lm.server's default --num-draft-tokens; both servers use it
ROUNDS = 5
MAX_TOKENS = 64
PROMPT = "The history of the lighthouse begins"
PLAIN, OURS, THEIRS = (
    "tandem, no speculation",
    "tandem --draft-model",
    "mlx_lm.server --draft-model",
)


def body(model: str | None) -> dict:
    found = {
        "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    return found if model is None else {**found, "model": model}


def float16_copy(target: Path, cache: Path) -> Path:
    """The float32 import converted to float16 by mlx-lm's own convert, once."""
    copy = cache / "bench" / f"{target.name}-float16"
    if not (copy / "config.json").is_file():
        from mlx_lm import convert

        copy.parent.mkdir(parents=True, exist_ok=True)
        convert(str(target), str(copy), dtype="float16")
    return copy


def speculation_counts(client: httpx.Client, server: ServerProcess) -> tuple[float, float]:
    """tandem's drafted and accepted tokens so far, from its /metrics."""
    found = {"drafted": 0.0, "accepted": 0.0}
    for line in client.get(f"{server.base_url}/metrics").text.splitlines():
        for key in found:
            if line.startswith(f"tandem_speculation_{key}"):
                found[key] += float(line.rsplit(" ", 1)[1])
    return found["drafted"], found["accepted"]


def measure_pair(target: Path, draft: Path, scratch: Path) -> str:
    """The three contenders on one target, interleaved; the pair's table."""
    mkl = activate().path
    with contextlib.ExitStack() as cleanup:
        servers = {}
        for name, extra in ((PLAIN, ["--num-draft-tokens", "0"]),
                            (OURS, ["--draft-model", str(draft),
                                    "--num-draft-tokens", str(DRAFTED)])):  # fmt: skip
            port = free_port(HOST)
            command = tandem_command(target, port, scratch / f"{target.name}-{len(servers)}")
            command[: command.index("serve")] = [sys.executable, "-m", "cli.main"]  # this tree
            servers[name] = ServerProcess(
                name, [*command, *extra], port, scratch / f"{target.name}-{len(servers)}.log"
            )
        port = free_port(HOST)
        theirs = [
            sys.executable, "-m", "mlx_lm", "server", "--model", str(target),
            "--draft-model", str(draft), "--num-draft-tokens", str(DRAFTED),
            "--host", HOST, "--port", str(port), "--prompt-cache-size", "0",
            "--log-level", "WARNING",
        ]  # fmt: skip
        env = dict(os.environ, LD_PRELOAD=mkl) if mkl else None
        servers[THEIRS] = ServerProcess(THEIRS, theirs, port, scratch / f"{target.name}.log", env)
        for server in servers.values():
            cleanup.callback(server.stop)
            server.start()
        client = cleanup.enter_context(httpx.Client(trust_env=False))
        for server in servers.values():
            server.wait_healthy(client, 600)
        ids = {
            name: client.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
            for name, server in servers.items()
            if name != THEIRS
        }

        def streamer(server: ServerProcess, model: str | None):
            url = f"{server.base_url}/v1/completions"
            return lambda: time_stream(client, url, body(model))

        contenders = {name: streamer(server, ids.get(name)) for name, server in servers.items()}
        samples: dict[str, list[Sample]] = run_interleaved(contenders, ROUNDS)
        drafted, accepted = speculation_counts(client, servers[OURS])
    rates = {name: [s.decode_tokens_per_s for s in found] for name, found in samples.items()}
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratios = sorted(o / t for o, t in zip(rates[OURS], rates[THEIRS], strict=True))
    rows = [
        [name, f"{medians[name]:.2f}", f"{min(rates[name]):.2f}-{max(rates[name]):.2f}"]
        for name in (PLAIN, OURS, THEIRS)
    ]
    generated = (ROUNDS + 1) * MAX_TOKENS  # with the warm-up
    return (
        markdown_table(["contender", "decode tok/s (median)", "range"], rows)
        + f"\ntandem / mlx_lm.server with the same pair: **{medians[OURS] / medians[THEIRS]:.2f}x**"
        f" (per-round {ratios[0]:.2f}-{ratios[-1]:.2f}); tandem / itself without a draft model "
        f"{medians[OURS] / medians[PLAIN]:.2f}x. tandem drafted {drafted:.0f} tokens for the "
        f"~{generated} it generated, {accepted:.0f} accepted.\n"
    )


class AlwaysDrafting(DraftModelDrafter):
    """The draft model as tandem runs it, never timed: it drafts at every step."""

    costly = False


def drafting_rates(target: Path, draft: Path) -> tuple[list[float], list[float]]:
    """Decode tok/s (after the first draft) of MAX_TOKENS greedy tokens, drafting DRAFTED per
    step at every step: tandem's lane, then mlx-lm's speculative step, in interleaved rounds."""
    import mlx.core as mx  # after engines/: MKL under mlx
    from mlx_lm import load
    from mlx_lm.generate import generation_stream, speculative_generate_step

    model, tokenizer = load(str(target))
    drafter_model, _ = load(str(draft))
    prompt = tokenizer.encode(PROMPT)

    def ours() -> float:
        drafter = partial(AlwaysDrafting, drafter_model, generation_stream)
        batch = DecodeBatch(model, 1, 512, most_drafted=DRAFTED, drafter=drafter)
        batch.insert(0, prompt, greedy, [])
        tokens, first = 0, None
        while tokens < MAX_TOKENS:
            outputs = batch.step()
            tokens += len(outputs)
            # timed from the first verified draft, as mlx-lm's from its first step: both
            # draft models have read the prompt by then
            if first is None and any(output.drafted for output in outputs):
                first = (time.perf_counter(), tokens)
        batch.close()
        return (tokens - first[1]) / (time.perf_counter() - first[0])

    def theirs() -> float:
        steps = speculative_generate_step(
            mx.array(prompt), model, drafter_model, num_draft_tokens=DRAFTED,
            max_tokens=MAX_TOKENS,
        )  # fmt: skip
        next(steps)
        started, tokens = time.perf_counter(), 0
        for _ in steps:
            tokens += 1
        return tokens / (time.perf_counter() - started)

    ours(), theirs()  # warm-up
    rates: tuple[list[float], list[float]] = ([], [])
    for _ in range(ROUNDS):
        rates[0].append(ours())
        rates[1].append(theirs())
    return rates


def drafting_table(target: Path, draft: Path) -> str:
    ours, theirs = drafting_rates(target, draft)
    ratios = sorted(o / t for o, t in zip(ours, theirs, strict=True))
    rows = [
        [name, f"{statistics.median(rates):.2f}", f"{min(rates):.2f}-{max(rates):.2f}"]
        for name, rates in (
            ("tandem's lane, always drafting", ours),
            ("mlx-lm speculative_generate_step", theirs),
        )
    ]
    return (
        markdown_table(["drafting every step (in process)", "decode tok/s (median)", "range"], rows)
        + f"\ntandem / mlx-lm: **{statistics.median(ratios):.2f}x** "
        f"(per-round {ratios[0]:.2f}-{ratios[-1]:.2f}).\n"
    )


def main() -> None:
    cache = Path.home() / ".cache" / "tandem"
    target32 = ensure_imported(smollm2_gguf(), cache, dequantize=True)
    draft = ensure_imported(smollm2_gguf(), cache, dequantize=False)
    if "--drafting-only" in sys.argv:
        print(drafting_table(target32, draft))
        return
    target16 = float16_copy(target32, cache)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as scratch:
        pairs = [
            (
                "4-bit drafting for a float16 copy (mlx_lm.server computes it in float16, where "
                "drafting pays; tandem in float32)",
                target16,
            ),
            (
                "4-bit drafting for float32 (drafting loses on this CPU: tandem steps aside)",
                target32,
            ),
        ]
        tables = [
            f"**{title}**\n\n" + measure_pair(target, draft, Path(scratch))
            for title, target in pairs
        ]
    tables.append("**The drafting itself**\n\n" + drafting_table(target32, draft))
    text = (
        f"`{COMMAND}`: SmolLM2-135M-Instruct's Q4_1 import (mlx 4-bit) drafting for a float16 "
        f"copy and for its float32 import, {DRAFTED} tokens per draft (mlx_lm.server's default, "
        f"both servers), one greedy stream of {MAX_TOKENS} tokens over HTTP (/v1/completions), "
        f"medians of {ROUNDS} interleaved rounds after a warm-up; mlx_lm.server with tandem's MKL "
        "preloaded. Each pair is one model twice, so it accepts optimistically.\n\n"
        + "\n".join(tables)
    )
    print(text)
    if "--no-write" not in sys.argv:
        write_section(HEADING, text)


if __name__ == "__main__":
    main()
