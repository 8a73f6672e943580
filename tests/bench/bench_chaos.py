"""A chaos soak: clients stream while workers and agents are killed, frozen and restarted.

Run from the project root: `python -m tests.bench.bench_chaos --strategy pp --minutes 10`
(and `--strategy tp`). A coordinator and agents on 127.0.0.1 serve the demo model (pp: two
agents, three stages; tp: one agent, two ranks over the ring). Six client threads stream chat
completions in a loop; a chaos thread, seeded, picks a fault every `--fault-every` seconds: kill
a worker, freeze a worker, kill an agent (restarted after a pause), freeze an agent (thawed after
a pause), kill the coordinator's engine-core process, freeze it (its watchdog kills it). It
reports requests finished, error events, 429s, 503s, hangs (a stream silent for
longer than --lost-after plus a margin), broken streams (ended with neither [DONE] nor an error
event), the seconds from the last fault until the cluster answered again, orphaned workers and
engine cores, and the coordinator's memory growth (its API process plus its engine core) beside
the prefix cache's bytes and its configured budget. The section
"## Chaos soak" of docs/benchmarks.md gets the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

from engines.model.demo import ensure_demo_model
from engines.model.demo_spec import DemoSpec
from tests.bench.common import markdown_table, write_section
from tests.helpers.cluster import AgentPool
from tests.helpers.serve import ServeProcess, start_serve

CLIENTS = 6
LOST_AFTER_S = 3.0
HANG_S = LOST_AFTER_S + 10.0  # silence that counts as a hang
PAUSE_S = (2.0, 6.0)  # how long a frozen or killed agent stays out
WORKER_MODULES = (
    "engines.pipeline.stage_worker",
    "engines.tensor_parallel.worker",
    "engines.core.core_main",
)
ACTIONS = (
    "kill worker", "freeze worker", "kill agent", "freeze agent", "kill core", "freeze core",
)  # fmt: skip


class Tally:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.ok_at: list[float] = []  # when each request finished well
        self.last_failure_at = 0.0  # when the last one did not
        self.bad_bodies: list[str] = []

    def add(self, outcome: str, body: str = "") -> None:
        with self.lock:
            self.counts[outcome] += 1
            if outcome == "finished":
                self.ok_at.append(time.monotonic())
            else:
                self.last_failure_at = time.monotonic()
            if body and len(self.bad_bodies) < 5:
                self.bad_bodies.append(body[:200])


def client_loop(base_url: str, stop: threading.Event, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=base_url, timeout=httpx.Timeout(60, read=HANG_S)) as client:
        while not stop.is_set():
            body = {
                "model": "demo", "stream": True, "max_tokens": rng.randint(8, 64),
                "messages": [{"role": "user", "content": f"tell me about {rng.random()}"}],
            }
            try:
                with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        text = response.read().decode(errors="replace")
                        shaped = "error" in json.loads(text or "{}")
                        kind = str(response.status_code) if shaped else "unshaped"
                        tally.add(kind, "" if shaped else text)
                        time.sleep(0.2)
                        continue
                    outcome = "broken"
                    for line in response.iter_lines():
                        if line == "data: [DONE]":
                            outcome = "finished" if outcome == "broken" else outcome
                        elif line.startswith("data: ") and '"error"' in line:
                            outcome = "error_event"
                    tally.add(outcome)
            except httpx.ReadTimeout:
                tally.add("hang")
            except (httpx.TransportError, ValueError) as error:
                tally.add("broken", str(error))


def member_pids(server: ServeProcess) -> dict[str, int]:
    try:
        members = server.cluster()["members"]
    except (httpx.HTTPError, KeyError, ValueError):
        return {}
    return {m["node_id"]: m["worker_pid"] for m in members if m.get("worker_pid")}


def engine_core(server: ServeProcess) -> psutil.Process | None:
    """The coordinator's engine-core process (a new one after every re-plan)."""
    try:
        children = psutil.Process(server.process.pid).children()
        return next(c for c in children if "engines.core.core_main" in " ".join(c.cmdline()))
    except (psutil.Error, StopIteration):
        return None


def coordinator_rss(server: ServeProcess) -> int:
    """serve's API process plus its engine core (the weights and prefix cache live there)."""
    core = engine_core(server)
    api = psutil.Process(server.process.pid).memory_info().rss
    try:
        return api + (core.memory_info().rss if core is not None else 0)
    except psutil.Error:
        return api


def chaos_loop(
    server: ServeProcess, pool: AgentPool, agents: list[Any], stop: threading.Event,
    seed: int, every_s: float, faults: list[tuple[float, str]], started: float,
) -> None:
    rng = random.Random(seed)
    while not stop.wait(every_s * rng.uniform(0.7, 1.3)):
        action = rng.choice(ACTIONS)
        index = rng.randrange(len(agents))
        agent = agents[index]
        if action.endswith("core"):
            core = engine_core(server)
            if core is None:
                continue
            try:
                core.send_signal(signal.SIGKILL if action == "kill core" else signal.SIGSTOP)
            except psutil.NoSuchProcess:
                continue
        elif action.endswith("worker"):
            pid = member_pids(server).get(agent.node_id)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGKILL if action == "kill worker" else signal.SIGSTOP)
            except ProcessLookupError:
                continue
        elif action == "kill agent":
            agent.kill()
            time.sleep(rng.uniform(*PAUSE_S))
            agents[index] = pool.start(
                f"agent{index}", real_roles=True, state_dir=agent.state_dir,
                lost_after_s=LOST_AFTER_S,
            )
        else:
            agent.signal(signal.SIGSTOP)
            time.sleep(rng.uniform(*PAUSE_S))
            agent.signal(signal.SIGCONT)
        faults.append((time.monotonic() - started, action))


def run(strategy: str, minutes: float, seed: int, every_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        model = ensure_demo_model(root / "model", DemoSpec())
        pool = AgentPool(root / "agents")
        before = {p.pid for p in psutil.process_iter()}
        server = None
        try:
            count = 2 if strategy == "pp" else 1
            agents = [
                pool.start(f"agent{i}", real_roles=True, lost_after_s=LOST_AFTER_S)
                for i in range(count)
            ]
            server = start_serve(
                root, model, pool.cluster_key,
                ["--parallelism", strategy, "--collective", "ring", "--model-id", "demo",
                 "--lost-after", str(LOST_AFTER_S), "--rediscover-interval", "2"],
            )
            hello = [{"role": "user", "content": "hi"}]
            warm = httpx.post(
                server.base_url + "/v1/chat/completions", timeout=60,
                json={"model": "demo", "max_tokens": 8, "messages": hello},
            )
            assert warm.status_code == 200, warm.text
            rss_start = coordinator_rss(server)
            tally, stop, faults = Tally(), threading.Event(), []
            started = time.monotonic()
            clients = [
                threading.Thread(target=client_loop, args=(server.base_url, stop, tally, seed + i))
                for i in range(CLIENTS)
            ]
            chaos_stop = threading.Event()
            chaos = threading.Thread(
                target=chaos_loop,
                args=(server, pool, agents, chaos_stop, seed, every_s, faults, started),
            )
            for thread in [*clients, chaos]:
                thread.start()
            time.sleep(minutes * 60)
            chaos_stop.set()
            chaos.join(60)
            last_fault = time.monotonic()
            for pid in member_pids(server).values():  # thaw a worker frozen last
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            # Recovered: the first good answer after the last failure, counted from the last
            # fault (a frozen member fails requests only once it is declared lost).
            if faults:
                last_fault = started + faults[-1][0]
            recovered_s = None
            while time.monotonic() - last_fault < 120:
                with tally.lock:
                    settled = max(last_fault, tally.last_failure_at)
                    good = [at for at in tally.ok_at if at > settled]
                if good and time.monotonic() - good[0] > 2 * LOST_AFTER_S:
                    recovered_s = good[0] - last_fault
                    break
                time.sleep(0.2)
            stop.set()
            for thread in clients:
                thread.join(HANG_S + 10)
            status = server.cluster()
            rss_end = coordinator_rss(server)
            prefix = (status.get("engine") or {}).get("prefix_cache") or {}
        finally:
            if server is not None:
                server.stop()
            pool.stop_all()
        time.sleep(2)
        orphans = [
            p.pid for p in psutil.process_iter(["pid", "cmdline"])
            if p.pid not in before
            and any(module in " ".join(p.info["cmdline"] or []) for module in WORKER_MODULES)
        ]
    return {
        "strategy": strategy, "minutes": minutes, "faults": faults, "counts": dict(tally.counts),
        "bad_bodies": tally.bad_bodies, "recovered_s": recovered_s, "orphans": orphans,
        "rss_growth": rss_end - rss_start, "prefix_cache_bytes": int(prefix.get("bytes") or 0),
        "prefix_cache_budget": int(prefix.get("max_bytes") or 0),
        "replans": status.get("replans"), "final_state": status.get("state"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", choices=("pp", "tp"), default="pp")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--fault-every", type=float, default=30.0)
    args = parser.parse_args()
    result = run(args.strategy, args.minutes, args.seed, args.fault_every)
    counts = result["counts"]
    kinds = Counter(action for _, action in result["faults"])
    rows = [[
        result["strategy"], f"{result['minutes']:g} min", f"{len(result['faults'])} ("
        + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")",
        str(counts.get("finished", 0)), str(counts.get("error_event", 0)),
        str(counts.get("429", 0)), str(counts.get("503", 0)), str(counts.get("hang", 0)),
        str(counts.get("broken", 0) + counts.get("unshaped", 0)),
        "—" if result["recovered_s"] is None else f"{result['recovered_s']:.1f} s",
        f"{result['rss_growth'] / 2**20:+.0f} MB "
        f"(prefix cache {result['prefix_cache_bytes'] >> 20} MB of a "
        f"{result['prefix_cache_budget'] >> 20} MB budget)",
        str(len(result["orphans"])),
    ]]
    table = markdown_table(
        ["engine", "run", "faults", "finished", "error events", "429", "503", "hangs",
         "broken", "recovered after last fault", "coordinator RSS growth (API + core)",
         "orphans"],
        rows,
    )
    print(table, json.dumps(result, indent=1, default=str))
    heading = "## Chaos soak"
    command = (
        f"`python -m tests.bench.bench_chaos --strategy {args.strategy} --minutes "
        f"{args.minutes:g} --seed {args.seed} --fault-every {args.fault_every:g}`"
    )
    doc = Path("docs/benchmarks.md").read_text()
    start = doc.find(f"\n{heading}\n")
    previous = ""
    if start >= 0:  # keep the other engine's row: one table for pp and tp
        end = doc.find("\n## ", start + 1)
        section = doc[start:] if end < 0 else doc[start:end]
        previous = "\n".join(
            line for line in section.splitlines()
            if line.startswith("| ") and not line.startswith(f"| {args.strategy} ")
            and not line.startswith("| engine") and not line.startswith("| ---")
        )
    lines = table.rstrip("\n").splitlines()
    body = "\n".join(lines[:2] + ([previous] if previous else []) + lines[2:])
    write_section(
        heading,
        f"{command} (and the same with the other `--strategy`): six clients streaming on "
        f"127.0.0.1 while a seeded chaos thread kills or freezes a worker, an agent or the "
        f"coordinator's engine core about every {args.fault_every:g} s "
        f"(`--lost-after {LOST_AFTER_S:g}`). A hang is a stream "
        f"silent for {HANG_S:g} s; broken is a stream that ended with neither [DONE] nor an "
        "error event, or a non-200 without an OpenAI-shaped body.\n\n" + body,
    )


if __name__ == "__main__":
    main()
