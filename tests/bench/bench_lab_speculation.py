"""Speculation in the lab (issue 41): one request's decode tok/s on copy-heavy prompts, served by
pp=2 (and, given three cores, tp=3) with prompt lookup over separate lab machines of one core
each, against single on one such machine without it.

Run from the project root, as root: `python -m tests.bench.bench_lab_speculation` (about fifteen
minutes; `--rounds N`, `--quick` for one round of one short prompt, `--no-write`). One lab holds
every contender's machines (tests/lab/machines.py), each pinned to a core; each contender's
`tandem serve` is started once and kept up, idle while another is timed. The model is the real
SmolLM2-135M-Instruct (float32 import): random demo models never copy; its 3 KV heads rule out
tp=2, and tp=3 needs three cores (below that, a short probe on CPU quotas shows why). The
client streams chat completions from the host, greedy; rounds interleave the contenders (each
round and prompt starts one contender later). Writes "## Speculation in the lab" in
docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from discovery.cluster_key import format_key, generate_key
from engines.model.gguf.cache import ensure_imported
from engines.model.smollm2 import serves_float_weights
from tests.bench.bench_scaling import environment
from tests.bench.bench_speculation import COPY_PROMPTS, FREE_PROMPTS
from tests.bench.common import PROJECT_ROOT, markdown_table, write_section
from tests.helpers.real_models import smollm2_gguf
from tests.lab.machines import Lab, Machine, MachineSpec, lab_unavailable

HEADING = "## Speculation in the lab"
COMMAND = "python -m tests.bench.bench_lab_speculation"
ROUNDS = 7
MAX_TOKENS = 96
QUICK_TOKENS = 24
DRAFTED = 8  # --num-draft-tokens (serve's default)
# mlx's ring busy-polls inside a collective, so tp's ranks need a core each. With fewer cores,
# a probe times one short request of tp=3 over machines of TP_QUOTA of a core each instead.
TP_CORES = 3
TP_QUOTA = 0.66
PROBE_TOKENS = 16
MEMORY_LIMIT = 4 * 1024**3  # a memory cgroup per machine, so that closing the lab sweeps it
PORT = 8000
READY_S = 300.0
MODEL_ID = "smollm2"
PYTHON = [sys.executable, "-m", "cli.main"]
PROMPTS = {
    **{f"{name} (copy)": text for name, text in COPY_PROMPTS.items()},
    "a story (free)": FREE_PROMPTS["a story"],
}
QUICK_PROMPT = "continue a list (copy)"


@dataclass(frozen=True, slots=True)
class Contender:
    """One `tandem serve` in the lab, on `machines` machines of one core each."""

    name: str
    parallelism: str
    machines: int
    drafted: int

    def specs(self, cores: int) -> list[MachineSpec]:
        return [
            MachineSpec(cores=str(index % cores), memory_limit=MEMORY_LIMIT)
            for index in range(self.machines)
        ]


SINGLE = Contender("single", "single", 1, 0)
SPECULATING = f"--num-draft-tokens {DRAFTED}"
PP = (Contender("pp=2", "pp", 2, 0), Contender(f"pp=2, {SPECULATING}", "pp", 2, DRAFTED))
TP = (Contender("tp=3", "tp", 3, 0), Contender(f"tp=3, {SPECULATING}", "tp", 3, DRAFTED))


def contenders_for(cores: int) -> tuple[Contender, ...]:
    return (SINGLE, *PP, *(TP if cores >= TP_CORES else ()))


@dataclass(frozen=True, slots=True)
class Run:
    text: str
    tokens: int
    decode_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class Server:
    url: str
    coordinator: Machine


def join(agent: Machine, key: str) -> None:
    agent.popen(
        [*PYTHON, "join", "--cluster-key", key, "--interface", agent.address],
        log=agent.home / "join.log", cwd=PROJECT_ROOT, env=environment(agent),
    )  # fmt: skip


def serve(contender: Contender, coordinator: Machine, key: str, model: Path) -> None:
    coordinator.popen(
        [*PYTHON, "serve", "--model", str(model), "--model-id", MODEL_ID,
         "--parallelism", contender.parallelism, "--collective", "ring",
         "--num-draft-tokens", str(contender.drafted), "--measure-speeds", "off",
         "--max-batch", "4", "--context-tokens", "2048", "--prefix-cache-bytes", "0",
         "--interface", coordinator.address, "--host", coordinator.address,
         "--port", str(PORT), "--cluster-key", key],
        log=coordinator.home / "serve.log", cwd=PROJECT_ROOT, env=environment(coordinator),
    )  # fmt: skip


def wait_for(what: str, ready: Any, log: Path) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.5)
    text = log.read_text() if log.exists() else "(no log)"
    raise RuntimeError(f"{what} not ready after {READY_S:.0f} s; {log}:\n{text[-3000:]}")


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).json().get("status") == "ok"
    except (httpx.HTTPError, ValueError):
        return False


def start_all(
    lab: Lab, contenders: tuple[Any, ...], model: Path, start_serve: Any = None
) -> dict[str, Server]:
    """Every contender's agents, then its serve (`start_serve(contender, coordinator, key,
    model)`, this module's serve by default); each checked to run the plan it was given.
    A contender has a name, a parallelism and a number of machines."""
    start_serve = start_serve or serve
    groups, taken = {}, 0
    for contender in contenders:
        groups[contender.name] = lab.machines[taken : taken + contender.machines]
        taken += contender.machines
    keys = {contender.name: format_key(generate_key()) for contender in contenders}
    for contender in contenders:
        for agent in groups[contender.name][1:]:
            join(agent, keys[contender.name])
    agents = [agent for group in groups.values() for agent in group[1:]]
    for agent in agents:
        log = agent.home / "join.log"
        wait_for(f"agent {agent.address}", lambda log=log: "ready on" in log.read_text(), log)
    servers = {}
    for contender in contenders:
        coordinator = groups[contender.name][0]
        start_serve(contender, coordinator, keys[contender.name], model)
        servers[contender.name] = Server(f"http://{coordinator.address}:{PORT}", coordinator)
    for contender in contenders:
        server = servers[contender.name]
        log = server.coordinator.home / "serve.log"
        wait_for(f"{contender.name}'s serve", lambda url=server.url: healthy(url), log)
        status = cluster(server.url)
        found = (status.get("strategy"), status.get("world_size"))
        if found != (contender.parallelism, contender.machines):
            raise RuntimeError(
                f"{contender.name} serves {found}, not "
                f"{(contender.parallelism, contender.machines)}; see {log}"
            )
    return servers


def cluster(url: str) -> dict[str, Any]:
    return httpx.get(url + "/v1/cluster", timeout=10).json()


def speculation(url: str) -> tuple[int, int]:
    """(accepted, drafted) so far by the serve's engine."""
    counts = (cluster(url).get("engine") or {}).get("speculation") or {}
    return counts.get("accepted", 0), counts.get("drafted", 0)


def chat(url: str, text: str, max_tokens: int) -> Run:
    """One greedy streamed chat completion: its text, its tokens (the usage), and its decode
    rate, the tokens after the first over the time from the first text to the last."""
    body = {
        "model": MODEL_ID, "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    pieces, stamps, tokens = [], [], 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    pieces.append(content)
                    stamps.append(time.perf_counter())
    if tokens < 2 or len(stamps) < 2:
        raise RuntimeError(f"{url}: too short an answer to time ({tokens} tokens): {pieces}")
    return Run("".join(pieces), tokens, (tokens - 1) / (stamps[-1] - stamps[0]))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def measure(
    servers: dict[str, Server], prompts: dict[str, str], rounds: int, max_tokens: int
) -> tuple[dict[tuple[str, str], list[Run]], dict[tuple[str, str], tuple[int, int]]]:
    """Runs per (prompt, contender) over `rounds` interleaved rounds after a warm-up, and the
    (accepted, drafted) each contender's engine counted over them."""
    names = list(servers)
    warm = next(iter(prompts.values()))
    for name in names:
        chat(servers[name].url, warm, max_tokens)
    runs: dict[tuple[str, str], list[Run]] = {(p, n): [] for p in prompts for n in names}
    counts = {(p, n): (0, 0) for p in prompts for n in names}
    for round_ in range(rounds):
        for index, (prompt, text) in enumerate(prompts.items()):
            shift = (round_ * len(prompts) + index) % len(names)
            for name in names[shift:] + names[:shift]:
                url = servers[name].url
                accepted, drafted = speculation(url)
                run = chat(url, text, max_tokens)
                after = speculation(url)
                before = counts[prompt, name]
                counts[prompt, name] = (
                    before[0] + after[0] - accepted,
                    before[1] + after[1] - drafted,
                )
                runs[prompt, name].append(run)
                print(f"round {round_ + 1} {prompt} | {name}: {run.tokens} tokens, "
                      f"{run.decode_tokens_per_s:.1f} tok/s", flush=True)  # fmt: skip
    return runs, counts


def table(
    contenders: tuple[Contender, ...],
    runs: dict[tuple[str, str], list[Run]],
    counts: dict[tuple[str, str], tuple[int, int]],
    prompts: dict[str, str],
) -> tuple[str, bool]:
    """The markdown table, and whether every contender's greedy text matched single's."""
    rows, all_same = [], True
    for prompt in prompts:
        reference = runs[prompt, SINGLE.name][0].text
        base = runs[prompt, SINGLE.name]
        for contender in contenders:
            found = runs[prompt, contender.name]
            rates = [run.decode_tokens_per_s for run in found]
            ratios = [
                run.decode_tokens_per_s / other.decode_tokens_per_s
                for run, other in zip(found, base, strict=True)
            ]
            same = all(run.text == reference for run in found)
            all_same = all_same and same
            accepted, drafted = counts[prompt, contender.name]
            rows.append([
                prompt, contender.name, str(found[0].tokens), spread(rates),
                "baseline" if contender is SINGLE else f"**{spread(ratios)}**",
                f"{accepted}/{drafted}" if contender.drafted else "-",
                "yes" if same else "**no**",
            ])  # fmt: skip
    header = [
        "prompt", "contender", "tokens", "decode tok/s, median (min-max)",
        "vs single, median (min-max)", "accepted / drafted", "same greedy text as single",
    ]  # fmt: skip
    return markdown_table(header, rows), all_same


def probe_tp(model: Path) -> dict[str, float]:
    """Decode tok/s of one short greedy request to single on one machine and to tp=3 over three,
    every machine TP_QUOTA of a core (a CPU quota, unpinned): tp on fewer than three cores."""
    specs = [MachineSpec(cpu_quota=TP_QUOTA, memory_limit=MEMORY_LIMIT)] * 4
    with Lab(len(specs), specs) as lab:
        servers = start_all(lab, (SINGLE, TP[0]), model)
        text = PROMPTS[QUICK_PROMPT]
        return {
            name: chat(server.url, text, PROBE_TOKENS).decode_tokens_per_s
            for name, server in servers.items()
        }


def option(name: str, default: int) -> int:
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def main() -> None:
    problem = lab_unavailable()
    if problem:
        raise SystemExit(f"bench_lab_speculation: {problem}")
    quick = "--quick" in sys.argv
    rounds = option("--rounds", 1 if quick else ROUNDS)
    max_tokens = QUICK_TOKENS if quick else MAX_TOKENS
    prompts = {QUICK_PROMPT: PROMPTS[QUICK_PROMPT]} if quick else PROMPTS
    model = ensure_imported(
        smollm2_gguf(), Path.home() / ".cache" / "tandem", dequantize=serves_float_weights()
    )
    cores = os.cpu_count() or 1
    contenders = contenders_for(cores)
    began = time.monotonic()
    specs = [spec for contender in contenders for spec in contender.specs(cores)]
    with Lab(len(specs), specs) as lab:
        servers = start_all(lab, contenders, model)
        print(f"every serve up after {time.monotonic() - began:.0f} s", flush=True)
        runs, counts = measure(servers, prompts, rounds, max_tokens)
    tp = "tp=3 over three machines beside them"
    if cores < TP_CORES:
        probe = probe_tp(model)
        tp = (
            f"no tp: SmolLM2's 3 KV heads rule out tp=2, and tp=3's three ranks on this "
            f"{cores}-core box stall each other, as mlx's ring busy-polls inside every "
            f"collective (a probe, {PROBE_TOKENS} tokens of '{QUICK_PROMPT}' on machines of "
            f"{TP_QUOTA} of a core each, a CPU quota: tp=3 {probe[TP[0].name]:.2f} tok/s, "
            f"single {probe[SINGLE.name]:.2f} tok/s)"
        )
        print(tp, flush=True)
    body, same = table(contenders, runs, counts, prompts)
    minutes = (time.monotonic() - began) / 60
    text = (
        f"`{COMMAND}` (as root; {minutes:.0f} minutes): SmolLM2-135M-Instruct (float32 import), "
        "one `tandem serve` per contender in one lab (tests/lab/machines.py), all started once "
        "and kept up, idle while another is timed; every machine pinned to one core, one BLAS "
        f"thread per process: single on one machine, pp=2 over two, {tp}. Speculating: "
        f"`{SPECULATING}` (prompt lookup); the others 0. One greedy chat stream at a time from "
        f"the host, up to {max_tokens} tokens; decode tok/s counts the tokens after the first "
        "over the time from the first text to the last. Medians of "
        f"{rounds} interleaved rounds after a warm-up; a ratio is per round, against single "
        "in the same round, and the spread is its lowest and highest. Issue 41's targets on "
        "copy prompts, one core per machine: pp=2 >= 1.5x and tp=2 >= 1.8x single without "
        "speculation.\n\n" + body
    )
    print(text)
    if not same:
        print("bench_lab_speculation: some greedy texts differ from single's", flush=True)
    if "--no-write" not in sys.argv:
        write_section(HEADING, text)


if __name__ == "__main__":
    main()
