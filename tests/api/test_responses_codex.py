"""Codex CLI itself (npm @openai/codex, headless `codex exec`) completes a turn against
`tandem serve` on the demo model, through the Responses dialect."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.cluster import new_key_text
from tests.helpers.npm_tools import npm_tool
from tests.helpers.prefetch import NPM_TOOLS
from tests.helpers.serve import start_serve

pytestmark = pytest.mark.cluster
CODEX_VERSION = NPM_TOOLS[1][1]  # the version whose requests docs/api.md describes
MODEL_ID = "tandem-demo"
# Random weights never end a reply on their own: Codex would get `response.incomplete`
# (max_output_tokens) and fail the turn. A JSON schema (`--output-schema`, sent as
# text.format) lets the grammar end it, as a real model's end of turn would.
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 16}},
    "required": ["answer"],
    "additionalProperties": False,
}
# The provider, and a short prompt: Codex's own instructions and its sub-agent and goal tools
# come to about 13,000 tokens, minutes of prefill for the demo model on a busy CPU.
CONFIG = """\
model = "{model}"
model_provider = "tandem"
model_instructions_file = "{instructions}"

[features]
multi_agent = false
goals = false

[model_providers.tandem]
name = "tandem"
base_url = "{base_url}/v1"
wire_api = "responses"
"""


def test_codex_exec_completes_a_turn(tmp_path: Path, demo_model_dir: Path) -> None:
    codex = npm_tool("@openai/codex", CODEX_VERSION, "codex")
    server = start_serve(
        tmp_path,
        demo_model_dir,
        new_key_text(),
        ["--parallelism", "single", "--model-id", MODEL_ID, "--context-tokens", "8192"],
    )
    try:
        home, work = tmp_path / "codex-home", tmp_path / "work"
        home.mkdir()
        work.mkdir()
        instructions = home / "instructions.md"
        instructions.write_text("You are a coding agent. Answer briefly.\n")
        schema = home / "answer.json"
        schema.write_text(json.dumps(ANSWER))
        config = CONFIG.format(model=MODEL_ID, instructions=instructions, base_url=server.base_url)
        (home / "config.toml").write_text(config)
        environment = {
            name: value for name, value in os.environ.items() if not name.startswith("OPENAI_")
        }
        finished = subprocess.run(
            [str(codex), "exec", "--skip-git-repo-check", "--json"]
            + ["--output-schema", str(schema), "Say hi."],
            cwd=work,
            env={**environment, "CODEX_HOME": str(home)},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
        )
        report = (
            f"{finished.stdout[-3000:]}\n{finished.stderr[-3000:]}\n{server.log_text()[-3000:]}"
        )
        assert finished.returncode == 0, report
        events = [json.loads(line) for line in finished.stdout.splitlines() if line.startswith("{")]
        kinds = [event["type"] for event in events]
        assert "turn.completed" in kinds and "turn.failed" not in kinds, report
        [answer] = [
            event["item"]["text"]
            for event in events
            if event["type"] == "item.completed" and event["item"]["type"] == "agent_message"
        ]
        assert set(json.loads(answer)) == {"answer"}
        usage = next(event["usage"] for event in events if event["type"] == "turn.completed")
        assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
        log = server.log_text()
        # Codex offers web_search on every request: tandem does not offer it to the model
        assert "not offering hosted tools ['web_search']" in log, report
    finally:
        server.stop()
