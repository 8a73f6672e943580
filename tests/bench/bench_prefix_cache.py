"""Prefix cache: a follow-up turn's time to first token against the first turn's, per engine.

Run from the project root: `python -m tests.bench.bench_prefix_cache` (several minutes). Part 1:
a conversation whose first turn carries a ~1,000-token system prompt (made unique per round so
that it starts cold), then a follow-up turn that repeats the whole history plus a new question;
both greedy, streamed, 8 tokens. Reported: median TTFT of each turn and their ratio, for
tandem serve (single, HTTP), mlx_lm.server (HTTP, its default prompt cache), tandem tp=2 and
pp=2 (driven in-process through the EngineRunner the API uses), tandem single with the
cache off, and tandem single whose entries all go to the disk tier (a 1 MB memory tier, so
every entry is written to disk, and the follow-up comes a second later, once it is written:
it is read back from its file; tp=2 and pp=2 have the same contender, in-process, each rank or
stage with its own directory). Part 2: 8 conversations sharing one system
prompt, two turns each, the 8 first turns sent at once, then the 8 follow-ups at once: the
prompt tokens the first turns computed (in prompts' worth: 8 when every one misses, about 1
when the others wait for the first one's prefill), their median TTFT, the prefix-cache hit
rate (cached prompt tokens over all prompt tokens) and completion tokens per second. Writes
"## Prefix cache" in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.model.demo import ensure_demo_model
from tests.bench.bench_single import MODEL, MODEL_CACHE, ServerProcess, tandem_command
from tests.bench.common import free_port, markdown_table, write_section

HOST = "127.0.0.1"
ROUNDS = 3
FIRST_TOKENS = 8
HEADING = "## Prefix cache"
COMMAND = "python -m tests.bench.bench_prefix_cache"
SYSTEM = (
    "You are the support assistant of a hardware shop. Be exact, be brief, quote the manual, "
    "and never invent part numbers. The manual follows. "
) + " ".join(
    f"Section {n}: the part fits models {n} to {n + 3} and needs tool {n % 7}." for n in range(30)
)
QUESTIONS = ("Which tool do I need for section 12?", "And for section 40, which models fit?")
CONVERSATIONS = 8


@dataclass(frozen=True, slots=True)
class Turn:
    first_token_s: float
    tokens: int
    text: str
    prompt_tokens: int
    cached_tokens: int


Ask = Callable[[str, int], Awaitable[Turn]]  # (prompt text, max_tokens) -> the turn


def http_asker(base_url: str, model_id: str | None, client: httpx.AsyncClient) -> Ask:
    async def ask(prompt: str, max_tokens: int) -> Turn:
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if model_id is not None:
            body["model"] = model_id
        started, first, text, usage = time.perf_counter(), None, "", {}
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"{base_url} answered {response.status_code}: {response.text}")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: ") :])
                piece = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                if piece and first is None:
                    first = time.perf_counter()
                text += piece
                usage = chunk.get("usage") or usage
        details = usage.get("prompt_tokens_details") or {}
        return Turn(
            (first or time.perf_counter()) - started,
            usage.get("completion_tokens", 0),
            text,
            usage.get("prompt_tokens", 0),
            details.get("cached_tokens", 0) or 0,
        )

    return ask


def runner_asker(runner: EngineRunner) -> Ask:
    tokenizer = runner.engine.tokenizer
    counter = iter(range(10**9))

    async def ask(prompt: str, max_tokens: int) -> Turn:
        tokens = tuple(tokenizer.encode(prompt))
        request = GenerationRequest(f"bench-{next(counter)}", tokens, max_tokens)
        started, first, text, completion, cached = time.perf_counter(), None, "", 0, 0
        async for event in runner.submit(request).events():
            if event.token is not None and first is None:
                first = time.perf_counter()
            text += event.text
            if event.finish_reason is not None:
                if event.error:
                    raise RuntimeError(event.error)
                completion, cached = event.completion_tokens, event.cached_tokens
        return Turn(first - started, completion, text, len(tokens), cached)

    return ask


DISK_TIER = "tandem single, entries on disk (HTTP)"
TP_DISK_TIER = "tandem tp=2, entries on disk (in-process)"
PP_DISK_TIER = "tandem pp=2, entries on disk (in-process)"
READ_PAUSE_S = 1.0  # before a follow-up to the disk tier: the entry's file is written by then


async def two_turns(ask: Ask, system: str, pause_s: float = 0.0) -> tuple[Turn, Turn]:
    first_prompt = f"{system}\nUser: {QUESTIONS[0]}\nAssistant:"
    first = await ask(first_prompt, FIRST_TOKENS)
    await asyncio.sleep(pause_s)  # the user reads the answer
    follow_prompt = f"{first_prompt}{first.text}\nUser: {QUESTIONS[1]}\nAssistant:"
    return first, await ask(follow_prompt, FIRST_TOKENS)


async def follow_up_ratio(
    ask: Ask, rounds: int, tag: str, pause_s: float = 0.0
) -> list[tuple[Turn, Turn]]:
    await two_turns(ask, f"[warm-up {tag}] {SYSTEM}", pause_s)
    return [
        await two_turns(ask, f"[round {index} {tag}] {SYSTEM}", pause_s) for index in range(rounds)
    ]


@dataclass(frozen=True, slots=True)
class Shared:
    """8 conversations with one system prompt, their first turns started together."""

    hit_rate: float  # cached prompt tokens over all prompt tokens, both turns
    completion_tokens: int
    wall_s: float
    first_computed: float  # prompt tokens the first turns computed, in prompts' worth
    first_ttft_s: float  # median first-turn time to first token


async def shared_system_prompt(ask: Ask, tag: str) -> Shared:
    """8 conversations, one system prompt: both turns of each, the first turns at once."""
    system = f"[shared {tag}] {SYSTEM}"
    started = time.perf_counter()
    firsts = await asyncio.gather(
        *(ask(f"{system}\nUser: question {n}?\nAssistant:", 32) for n in range(CONVERSATIONS))
    )
    follows = await asyncio.gather(
        *(
            ask(
                f"{system}\nUser: question {n}?\nAssistant:{turn.text}\nUser: more?\nAssistant:", 32
            )
            for n, turn in enumerate(firsts)
        )
    )
    wall = time.perf_counter() - started
    turns = [*firsts, *follows]
    prompt = sum(turn.prompt_tokens for turn in turns)
    cached = sum(turn.cached_tokens for turn in turns)
    computed = sum(turn.prompt_tokens - turn.cached_tokens for turn in firsts)
    return Shared(
        cached / prompt if prompt else 0.0,
        sum(t.tokens for t in turns),
        wall,
        computed / statistics.mean(turn.prompt_tokens for turn in firsts),
        statistics.median(turn.first_token_s for turn in firsts),
    )


def build(model_path: Path, cleanup: contextlib.ExitStack, only: list[str] | None):
    from tests.bench.pipeline_cluster import open_pipeline_runner
    from tests.bench.tp_cluster import open_tensor_parallel_runner

    wanted = (lambda name: any(part in name for part in only)) if only else (lambda name: True)
    scratch = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="tandem-prefix-")))
    client = cleanup.enter_context(httpx.Client(trust_env=False))
    # one event loop runs the whole measurement, so one async client serves every HTTP contender
    async_client = httpx.AsyncClient(
        trust_env=False, timeout=600, limits=httpx.Limits(max_connections=32)
    )
    askers: dict[str, Ask] = {}
    for name, extra in (
        ("tandem single (HTTP)", []),
        ("tandem single, cache off (HTTP)", ["--prefix-cache-bytes", "0"]),
        (DISK_TIER, ["--prefix-cache-bytes", "1M", "--prefix-cache-disk-bytes", "4G"]),
    ):
        if wanted(name):
            port = free_port(HOST)
            command = tandem_command(model_path, port, scratch) + extra
            server = ServerProcess(name, command, port, scratch / f"{port}.log")
            cleanup.callback(server.stop)
            server.start()
            server.wait_healthy(client)
            model_id = client.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
            askers[name] = http_asker(server.base_url, model_id, async_client)
    if wanted("mlx_lm.server (HTTP)"):
        port = free_port(HOST)
        command = [
            sys.executable, "-m", "mlx_lm", "server", "--model", str(model_path),
            "--host", HOST, "--port", str(port), "--log-level", "WARNING",
        ]  # fmt: skip
        server = ServerProcess("mlx_lm.server", command, port, scratch / "mlx.log")
        cleanup.callback(server.stop)
        server.start()
        server.wait_healthy(client)
        askers["mlx_lm.server (HTTP)"] = http_asker(server.base_url, None, async_client)
    budget = 1 << 30
    if wanted("tandem tp=2 (in-process)"):
        runner = cleanup.enter_context(
            open_tensor_parallel_runner(model_path, 2, prefix_cache_bytes=budget)
        )
        askers["tandem tp=2 (in-process)"] = runner_asker(runner)
    if wanted(TP_DISK_TIER):
        runner = cleanup.enter_context(
            open_tensor_parallel_runner(
                model_path, 2, prefix_cache_bytes=1 << 20, prefix_cache_disk_bytes=4 << 30,
                prefix_cache_dir=str(scratch / "tp-tiers"),
            )
        )  # fmt: skip
        askers[TP_DISK_TIER] = runner_asker(runner)
    if wanted("tandem pp=2 (in-process)"):
        runner = cleanup.enter_context(
            open_pipeline_runner(model_path, 2, prefix_cache_bytes=budget)
        )
        askers["tandem pp=2 (in-process)"] = runner_asker(runner)
    if wanted(PP_DISK_TIER):
        runner = cleanup.enter_context(
            open_pipeline_runner(
                model_path, 2, prefix_cache_bytes=1 << 20, prefix_cache_disk_bytes=4 << 30,
                prefix_cache_dir=scratch / "pp-tiers",
            )
        )  # fmt: skip
        askers[PP_DISK_TIER] = runner_asker(runner)
    return askers


def render(results: dict[str, Any], rounds: int, command: str) -> str:
    rows, shared_rows = [], []
    for name, (pairs, shared) in results.items():
        first = statistics.median(a.first_token_s for a, _ in pairs)
        follow = statistics.median(b.first_token_s for _, b in pairs)
        prompt = statistics.median(b.prompt_tokens for _, b in pairs)
        cached = statistics.median(b.cached_tokens for _, b in pairs)
        rows.append(
            [
                name,
                f"{prompt:.0f}",
                f"{cached:.0f}",
                f"{first:.2f}",
                f"{follow:.2f}",
                f"{follow / first:.3f}x",
            ]
        )
        shared_rows.append(
            [
                name,
                f"{shared.first_computed:.1f}",
                f"{shared.first_ttft_s:.2f}",
                f"{shared.hit_rate:.0%}",
                f"{shared.completion_tokens / shared.wall_s:.1f}",
                f"{shared.wall_s:.1f}",
            ]
        )
    return (
        f"`{command}` — demo model ({MODEL.layers} layers x hidden {MODEL.hidden}), "
        f"medians of {rounds} rounds, {FIRST_TOKENS} greedy tokens per turn.\n\n"
        "Follow-up turn vs first turn, ~1,000-token system prompt (unique per round):\n\n"
        + markdown_table(
            [
                "contender",
                "follow-up prompt tokens",
                "cached",
                "first TTFT s",
                "follow-up TTFT s",
                "follow-up / first",
            ],
            rows,
        )
        + f"\n{CONVERSATIONS} conversations sharing one system prompt, 2 turns each (8 first turns "
        "at once, then 8 follow-ups at once, 32 tokens per turn):\n\n"
        + markdown_table(
            [
                "contender",
                "first turns: prompts computed",
                "first-turn TTFT p50 s",
                "prompt-cache hit rate",
                "completion tok/s",
                "wall s",
            ],
            shared_rows,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--only", nargs="*", help="contender names to keep (substring match)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs alone")
    arguments = parser.parse_args()
    model_path = ensure_demo_model(MODEL_CACHE, MODEL)
    results: dict[str, Any] = {}

    async def measure_all(askers: dict[str, Ask]) -> None:
        for index, (name, ask) in enumerate(askers.items()):
            pause_s = READ_PAUSE_S if name in (DISK_TIER, TP_DISK_TIER, PP_DISK_TIER) else 0.0
            pairs = await follow_up_ratio(ask, arguments.rounds, str(index), pause_s)
            shared = await shared_system_prompt(ask, str(index))
            results[name] = (pairs, shared)
            print(render({name: results[name]}, arguments.rounds, name), flush=True)

    with contextlib.ExitStack() as cleanup:
        asyncio.run(measure_all(build(model_path, cleanup, arguments.only)))
    body = render(results, arguments.rounds, " ".join([COMMAND, *sys.argv[1:]]))
    sys.stdout.write(body + "\n")
    if not arguments.no_write:
        write_section(HEADING, body)


if __name__ == "__main__":
    main()
