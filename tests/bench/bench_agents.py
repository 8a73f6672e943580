"""Claude Code fixing a planted bug (tests/helpers/agent_task.py) through `tandem serve` (single,
and pp=2 with a `tandem join` on loopback) and through llama.cpp's `llama-server`, the same GGUF
(Qwen2.5-Coder-1.5B-Instruct) and the same `claude -p` command, in interleaved rounds.

Per run: whether the repository's test passes after it, the wall time, the turns, the first
turn's time to first token (Claude Code's own `ttft_ms`), and the tokens it reports (prompt
tokens read fresh, read from the server's prefix cache, written).

    python -m tests.bench.bench_agents --llama-server PATH [--rounds 3] [--no-write]

llama-server is built as for bench_gguf_servers (docs/benchmarks.md "GGUF served: tandem and
llama.cpp"). Needs npm's Claude Code in the tests' cache (`python -m tests.helpers.prefetch`).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
from pathlib import Path

import httpx

from engines.model.pypi_models import QWEN_CODER_1_5B
from tests.bench.bench_single import ServerProcess, tandem_command
from tests.bench.common import free_port, markdown_table, write_section
from tests.helpers.agent_task import SERVE_FLAGS, AgentRun, run_claude_code
from tests.helpers.cluster import new_key_text, start_agent
from tests.helpers.npm_tools import npm_tool
from tests.helpers.prefetch import NPM_TOOLS
from tests.helpers.real_models import real_gguf

HEADING = "## Agents: Claude Code fixes a bug"
COMMAND = "python -m tests.bench.bench_agents --llama-server PATH"
API_KEY = "bench-agents-key"
MODEL = QWEN_CODER_1_5B.model_id
CONTEXT_TOKENS = 16384


def llama_command(llama_server: Path, gguf: Path, port: int) -> list[str]:
    # Its chat template through --jinja (tools), greedy like tandem's --temperature 0.
    return [
        str(llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-t", "2", "-c", str(CONTEXT_TOKENS), "--jinja", "--temp", "0", "--alias", MODEL,
        "--api-key", API_KEY,
    ]  # fmt: skip


def summary(runs: list[AgentRun]) -> list[str]:
    def median(values: list[float]) -> str:
        return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

    usage = [run.result.get("usage") or {} for run in runs]
    return [
        f"{sum(run.fixed for run in runs)} of {len(runs)}",
        median([run.wall_s for run in runs]),
        median([float(run.turns) for run in runs]),
        median([(run.result.get("ttft_ms") or 0) / 1000 for run in runs]),
        median([float(u.get("input_tokens") or 0) for u in usage]),
        median([float(u.get("cache_read_input_tokens") or 0) for u in usage]),
        median([float(u.get("output_tokens") or 0) for u in usage]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    arguments = parser.parse_args()
    claude = npm_tool("@anthropic-ai/claude-code", NPM_TOOLS[0][1], "claude")
    gguf = real_gguf(QWEN_CODER_1_5B)
    scratch = Path(tempfile.mkdtemp(prefix="bench-agents-"))
    tandem_port, llama_port = free_port(), free_port()
    pp_port, key = free_port(), new_key_text()
    flags = ["--api-key", API_KEY, *SERVE_FLAGS]
    tandem = ServerProcess(
        "tandem single", tandem_command(gguf, tandem_port, scratch / "single") + flags,
        tandem_port, scratch / "tandem.log",
    )  # fmt: skip
    pp_flags = [*flags, "--cluster-key", key]
    pipeline = ServerProcess(
        "tandem pp=2 (loopback)",
        tandem_command(gguf, pp_port, scratch / "pp") + pp_flags,
        pp_port, scratch / "pipeline.log",
    )  # fmt: skip
    pipeline.command[pipeline.command.index("single")] = "pp"
    llama = ServerProcess(
        "llama-server", llama_command(arguments.llama_server, gguf, llama_port), llama_port,
        scratch / "llama.log",
    )  # fmt: skip
    servers = [tandem, pipeline, llama]
    runs: dict[str, list[AgentRun]] = {server.name: [] for server in servers}
    stage = None
    with httpx.Client() as client:
        try:
            stage = start_agent(scratch / "stage1", key, real_roles=True)
            for server in servers:
                server.start()
                server.wait_healthy(client, 900)
            for round_index in range(arguments.rounds):
                for server in servers if round_index % 2 == 0 else servers[::-1]:
                    place = scratch / f"server{servers.index(server)}-round{round_index}"
                    run = run_claude_code(
                        claude, server.base_url, API_KEY, MODEL, place / "repo", place / "home",
                    )  # fmt: skip
                    runs[server.name].append(run)
                    print(f"round {round_index} {server.name}: fixed={run.fixed} "
                          f"{run.wall_s:.1f} s, {run.turns} turns", flush=True)  # fmt: skip
        finally:
            for server in servers:
                server.stop()
            if stage is not None:
                stage.stop()
    table = markdown_table(
        ["server", "bug fixed", "wall s", "turns", "first-turn TTFT s", "prompt tokens fresh",
         "prompt tokens from cache", "tokens written"],
        [[name, *summary(found)] for name, found in runs.items()],
    )  # fmt: skip
    body = (
        f"`{COMMAND}` ({datetime.date.today()}, {arguments.rounds} interleaved rounds; medians "
        "with the lowest and highest run): Claude Code "
        f"{NPM_TOOLS[0][1]} (`claude -p`, tools Read and Edit, a three-sentence system "
        "prompt: tests/helpers/agent_task.py) fixing `average` in a two-file repository, "
        f"{QWEN_CODER_1_5B.title}'s GGUF served as given by each: `tandem serve "
        f"{' '.join(SERVE_FLAGS)}` (pp=2: `--parallelism pp` with one `tandem join` on "
        "loopback, the same two cores) and `llama-server --jinja --temp 0 -c "
        f"{CONTEXT_TOKENS} -t 2`. "
        "'Bug fixed': the repository's own test passes afterwards. Token counts are Claude "
        "Code's own report of its last turn.\n\n" + table
    )
    print(body)
    if not arguments.no_write:
        write_section(HEADING, body)


if __name__ == "__main__":
    main()
