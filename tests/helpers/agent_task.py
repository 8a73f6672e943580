"""A planted bug for a coding agent to fix: a two-file repository whose own test fails until
`average` in calc.py divides by the right count, and Claude Code (`claude -p`) run headless
against a server to fix it. The suite (tests/agents) and the agent benchmark
(tests/bench/bench_agents.py) share it, so both measure the same job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CALC = '''def average(values):
    """The mean of a non-empty list of numbers."""
    return sum(values) / (len(values) + 1)
'''
TEST = '''from calc import average


def test_average():
    assert average([2, 4, 6]) == 4
'''
# Claude Code's own 5.5 KB system prompt made the 1.5B answer by repeating a
# <system-reminder> block (docs/api.md): three sentences say what the job needs.
SYSTEM_PROMPT = (
    "You are a coding agent working in {work}. Do the task with the tools: read a file with "
    "Read, change it with Edit (old_string copied exactly from the file). Call one tool at a "
    "time; when the task is done, say so in one sentence."
)
TASK = (
    "The test in {work}/test_calc.py fails because of a bug in {work}/calc.py. Read "
    "{work}/calc.py, then fix the bug with the Edit tool."
)
CLAUDE_TOOLS = "Read,Edit"  # the first prompt stays ~2,200 tokens: under a minute of prefill
# Nothing phones home, nothing of the calling environment leaks in (CLAUDECODE, keys).
QUIET = {
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_BUG_COMMAND": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "NO_PROXY": "127.0.0.1,localhost",
}
# A first turn on a busy 2-core CPU can take minutes to its first token: Claude Code's own
# stream-idle and request timeouts would give up first.
PATIENCE_MS = "900000"
# What `tandem serve` needs for the job (docs/api.md "Using tandem from Claude Code").
SERVE_FLAGS = ("--model-alias", "claude-*", "--context-tokens", "16384", "--max-batch", "2",
               "--temperature", "0")  # fmt: skip


def plant_bug(work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    (work / "calc.py").write_text(CALC)
    (work / "test_calc.py").write_text(TEST)


def repository_test_passes(work: Path) -> bool:
    """Whether the repository's own test passes now (run as its own interpreter)."""
    check = "import test_calc; test_calc.test_average()"
    finished = subprocess.run(
        [sys.executable, "-c", check], cwd=work, capture_output=True, timeout=60
    )
    return finished.returncode == 0


@dataclass
class AgentRun:
    fixed: bool
    wall_s: float
    turns: int
    returncode: int
    result: dict
    output: str  # the tail of what the agent printed, for a failure's report


def run_claude_code(
    claude: Path, base_url: str, api_key: str, model: str, work: Path, home: Path,
    timeout_s: float = 600.0,
) -> AgentRun:  # fmt: skip
    """Claude Code fixing the planted bug in `work` through the server at `base_url`."""
    plant_bug(work)
    home.mkdir(parents=True, exist_ok=True)
    environment = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": api_key,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": PATIENCE_MS,
        "API_TIMEOUT_MS": PATIENCE_MS,
        **QUIET,
    }
    command = [
        str(claude), "-p", TASK.format(work=work),
        "--tools", CLAUDE_TOOLS, "--allowedTools", CLAUDE_TOOLS,
        "--permission-mode", "acceptEdits",  # as root, skipping permissions is refused
        "--output-format", "json",
        "--system-prompt", SYSTEM_PROMPT.format(work=work),
    ]  # fmt: skip
    started = time.monotonic()
    finished = subprocess.run(
        command, cwd=work, env=environment, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    wall = time.monotonic() - started
    try:
        result = json.loads(finished.stdout)
    except json.JSONDecodeError:
        result = {}
    return AgentRun(
        fixed=repository_test_passes(work),
        wall_s=wall,
        turns=int(result.get("num_turns") or 0),
        returncode=finished.returncode,
        result=result,
        output=f"{finished.stdout[-3000:]}\n{finished.stderr[-2000:]}",
    )
