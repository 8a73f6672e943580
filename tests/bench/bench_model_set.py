"""Two models served at once, each against itself served alone on the same server.

Run from the project root: `python -m tests.bench.bench_model_set` (about 6 minutes).
One `tandem serve --model A --model B` (two demo models, single on this machine: each its
own engine core process, `--blas-threads 1` so each core keeps to one of the two cores).
Interleaved rounds of three phases: A alone, B alone, A and B at once (`STREAMS` streams to
each, 64 greedy tokens per stream); aggregate tok/s per model and the ratio together/alone,
medians over the rounds with the spread. Then the time from `POST /v1/models` to the first
answer of a model already on disk, and from a keep-alive unload to the answer of the next
request (an on-demand reload), each a median of `LOADS`.

Writes "## Several models" in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from engines.model.demo import ensure_demo_model
from engines.model.demo_spec import DemoSpec
from tests.bench.bench_batching import Burst, http_contender
from tests.bench.bench_engine_core import tandem
from tests.bench.common import describe_machine, markdown_table, write_section

HEADING = "## Several models"
COMMAND = "python -m tests.bench.bench_model_set"
STREAMS = 4
LOADS = 5
MODEL_A = DemoSpec(layers=8, hidden=512, heads=8, kv_heads=8)  # the benchmarks' 8x512 demo
MODEL_B = DemoSpec(layers=8, hidden=512, heads=8, kv_heads=8, seed=1)  # same shape, other weights


def phase(base_url: str, ids: list[str]) -> dict[str, Burst]:
    """STREAMS streams to each model in `ids`, all at once."""

    async def run() -> list[Burst]:
        return await asyncio.gather(*(http_contender(base_url, i, 0.0)(STREAMS) for i in ids))

    return dict(zip(ids, asyncio.run(run()), strict=True))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def first_answer_s(client: httpx.Client, base_url: str, model_id: str) -> float:
    """Seconds until a one-token completion of `model_id` succeeds."""
    started = time.perf_counter()
    while True:
        reply = client.post(
            f"{base_url}/v1/completions",
            json={"model": model_id, "prompt": "hello", "max_tokens": 1},
            timeout=120,
        )
        if reply.status_code == 200:
            return time.perf_counter() - started
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch_dir, contextlib.ExitStack() as cleanup:
        scratch = Path(scratch_dir)
        model_a = ensure_demo_model(scratch / "a", MODEL_A)
        model_b = ensure_demo_model(scratch / "b", MODEL_B)
        client = httpx.Client(trust_env=False, timeout=120)
        cleanup.callback(client.close)
        server = tandem(
            "two models", model_a, scratch, cleanup, client,
            ["--model", str(model_b), "--model-id", "a", "--max-batch", "16",
             "--blas-threads", "1", "--keep-alive", "0"],
        )  # fmt: skip
        base = server.base_url
        ids = [card["id"] for card in client.get(f"{base}/v1/models").json()["data"]]
        phase(base, ids)  # warm both
        alone: dict[str, list[float]] = {i: [] for i in ids}
        together: dict[str, list[float]] = {i: [] for i in ids}
        for _ in range(args.rounds):
            for model_id in ids:
                alone[model_id].append(phase(base, [model_id])[model_id].tokens_per_s)
            for model_id, burst in phase(base, ids).items():
                together[model_id].append(burst.tokens_per_s)
        rows = []
        for model_id in ids:
            ratios = [t / a for t, a in zip(together[model_id], alone[model_id], strict=True)]
            rows.append([model_id, spread(alone[model_id]), spread(together[model_id]),
                         spread(ratios)])  # fmt: skip

        loads, reloads = [], []
        for index in range(LOADS):
            started = time.perf_counter()
            body = {"model": str(model_b), "id": f"c{index}"}
            reply = client.post(f"{base}/v1/models", json=body)
            assert reply.status_code == 202, reply.text
            first_answer_s(client, base, f"c{index}")
            loads.append(time.perf_counter() - started)
            client.delete(f"{base}/v1/models/c{index}")
        server.stop()

        keeper = tandem(
            "keep-alive", model_a, scratch, cleanup, client,
            ["--model-id", "a", "--blas-threads", "1", "--keep-alive", "1"],
        )  # fmt: skip
        for _ in range(LOADS):
            listing = f"{keeper.base_url}/v1/models"
            while client.get(listing).json()["data"][0]["state"] != "unloaded":
                time.sleep(0.1)
            reloads.append(first_answer_s(client, keeper.base_url, "a"))

    table = markdown_table(
        ["model", f"alone, {STREAMS} streams (tok/s)", "with the other's load (tok/s)",
         "together / alone"],
        rows,
    )  # fmt: skip
    loading = markdown_table(
        ["", "seconds, median (min-max)"],
        [["`POST /v1/models` of a model on disk, to its first answer", spread(loads)],
         ["an on-demand reload after a keep-alive unload, to the answer", spread(reloads)]],
    )  # fmt: skip
    body = (
        f"Command: `{COMMAND}` (--rounds {args.rounds}). {describe_machine()}\n\n"
        f"One `tandem serve` with two 8-layer hidden-512 demo models (same shape, other "
        f"weights), single on this machine, each in its own engine core with one BLAS thread. "
        f"Rounds interleave A alone, B alone, and both at once, {STREAMS} greedy streams of 64 "
        f"tokens to each; medians over {args.rounds} rounds with the range.\n\n"
        f"{table}\n{loading}"
    )
    write_section(HEADING, body)
    print(body)


if __name__ == "__main__":
    main()
