"""Strangers on the LAN against a three-stage pipeline: does anything the running streams do wait?

Run from the project root: `python -m tests.bench.bench_strangers [--hold 60]` (about two
minutes). A coordinator and two agents on 127.0.0.1 serve the demo model as pp=3. Eight greedy
streams decode in rounds; for `--hold` seconds 50 silent, 50 trickling and 50 unproven-hello
connections are held against every stage's port and every agent's control port, with 500 idle
HTTP connections (a few trickling a request line), and the rounds go on. The section
"## Strangers" of docs/benchmarks.md gets the inter-token gaps with and without them, the
re-plans, the replaced workers and /health's latency.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from engines.model.demo import ensure_demo_model
from engines.model.demo_spec import DemoSpec
from tests.bench.common import markdown_table, write_section
from tests.helpers.cluster import AgentPool
from tests.helpers.serve import ServeProcess, start_serve
from tests.helpers.strangers import Strangers, stream_all

STREAMS = 8
MAX_TOKENS = 64
PER_KIND = 50
IDLE_HTTP = 500


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def workers(server: ServeProcess) -> dict[str, int]:
    return {m["node_id"]: m["worker_pid"] for m in server.cluster()["members"]}


def rounds_for(server: ServeProcess, seconds: float, texts: list[str]) -> list[float]:
    """Rounds of STREAMS streams for at least `seconds`; every round must say `texts`."""
    gaps: list[float] = []
    deadline = time.monotonic() + seconds
    while True:
        said, round_gaps = stream_all(server, STREAMS, MAX_TOKENS)
        assert said == texts, "a stream said something else"
        gaps += round_gaps
        if time.monotonic() >= deadline:
            return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hold", type=float, default=60.0, help="seconds strangers stay")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        model = ensure_demo_model(root / "model", DemoSpec())
        pool = AgentPool(root / "agents")
        server = None
        try:
            agents = [pool.start(name, real_roles=True) for name in ("a1", "a2")]
            server = start_serve(
                root, model, pool.cluster_key, ["--parallelism", "pp", "--model-id", "demo"]
            )
            cluster = server.cluster()
            stages = cluster["engine"]["stages"][1:]
            stage_ports = [int(stage["address"].rsplit(":", 1)[1]) for stage in stages]
            ports = stage_ports + [agent.port for agent in agents]
            http_port = int(server.base_url.rsplit(":", 1)[1])
            texts, _ = stream_all(server, STREAMS, MAX_TOKENS)
            before_workers, replans = workers(server), cluster["replans"]
            quiet = rounds_for(server, args.hold / 4, texts)
            with Strangers(ports, http_port, PER_KIND, IDLE_HTTP) as strangers:
                time.sleep(1.0)
                started = time.monotonic()
                assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
                health_s = time.monotonic() - started
                busy = rounds_for(server, args.hold, texts)
                reopened = strangers.reopened
            quiet += rounds_for(server, args.hold / 4, texts)
            after = server.cluster()
            replaced = sum(before_workers.get(n, pid) != pid for n, pid in workers(server).items())
        finally:
            if server is not None:
                server.stop()
            pool.stop_all()
    rows = [
        [name, f"{len(gaps)}", f"{1000 * statistics.median(gaps):.1f}",
         f"{1000 * percentile(gaps, 0.95):.1f}", f"{1000 * max(gaps):.0f}"]
        for name, gaps in (("quiet", quiet), ("strangers held", busy))
    ]
    ratio = percentile(busy, 0.95) / percentile(quiet, 0.95)
    body = (
        f"`python -m tests.bench.bench_strangers --hold {args.hold:g}`: pp=3 (coordinator + two "
        f"agents on 127.0.0.1, demo model), {STREAMS} greedy streams of {MAX_TOKENS} tokens in "
        f"rounds; for {args.hold:g} s, {PER_KIND} silent + {PER_KIND} trickling + {PER_KIND} "
        f"unproven-hello connections held against each of {len(ports)} ports (both stages, both "
        f"agents' control ports; {reopened} connections opened in all as the cluster dropped "
        f"them) and {IDLE_HTTP} idle HTTP connections.\n\n"
        + markdown_table(["phase", "gaps", "median ms", "p95 ms", "max ms"], rows)
        + f"\np95 inter-token gap with strangers / without: **{ratio:.2f}x**; re-plans during "
        f"the run: {after['replans'] - replans}; workers replaced: {replaced}; /health with "
        f"{IDLE_HTTP} idle HTTP connections open: {1000 * health_s:.0f} ms; every stream said "
        "the same tokens in every round.\n"
    )
    print(body)
    write_section("## Strangers", body)


if __name__ == "__main__":
    main()
