"""Claude Code (`claude -p`, npm @anthropic-ai/claude-code) fixes a planted bug through `tandem
serve` on real weights: Qwen2.5-Coder-1.5B-Instruct's GGUF, served quantized as given. The
model ends the turn itself (no output schema); the repository's own test decides.

Skips only where npm and node are absent (tests/helpers/npm_tools.py). About a minute of the
agent here: its first prompt (~2,200 tokens) is prefilled once, the later turns reuse it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.model.pypi_models import QWEN_CODER_1_5B
from tests.helpers.agent_task import SERVE_FLAGS, repository_test_passes, run_claude_code
from tests.helpers.cluster import new_key_text
from tests.helpers.npm_tools import npm_tool
from tests.helpers.prefetch import NPM_TOOLS
from tests.helpers.real_models import real_gguf
from tests.helpers.serve import start_serve

pytestmark = pytest.mark.cluster
CLAUDE_CODE_VERSION = NPM_TOOLS[0][1]
API_KEY = "agent-test-key"
LOAD_TIMEOUT_S = 600  # the GGUF's import into this test's cache, then the load
AGENT_TIMEOUT_S = 900  # a busy CI machine runs the three turns several times slower


def test_claude_code_fixes_the_planted_bug(tmp_path: Path) -> None:
    claude = npm_tool("@anthropic-ai/claude-code", CLAUDE_CODE_VERSION, "claude")
    flags = ["--parallelism", "single", "--api-key", API_KEY, *SERVE_FLAGS]
    server = start_serve(tmp_path, real_gguf(QWEN_CODER_1_5B), new_key_text(), flags, wait=False)
    try:
        server.wait_healthy(LOAD_TIMEOUT_S)
        work = tmp_path / "repo"
        run = run_claude_code(
            claude, server.base_url, API_KEY, QWEN_CODER_1_5B.model_id, work,
            tmp_path / "claude-home", timeout_s=AGENT_TIMEOUT_S,
        )  # fmt: skip
        report = f"{run.output}\ncalc.py now:\n{(work / 'calc.py').read_text()}\n"
        report += server.log_text()[-3000:]
        assert run.returncode == 0, report
        assert run.result.get("is_error") is False, report
        assert run.fixed and repository_test_passes(work), report
        assert run.turns >= 2, report  # a read, then an edit: the fix came through tools
    finally:
        server.stop()
