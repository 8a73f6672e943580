"""Claude Code itself (npm @anthropic-ai/claude-code, headless `claude -p`) completes a turn
against `tandem serve` on the demo model, through the Messages dialect; every request it makes
is recorded on the way and answered without an error."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.agent_task import QUIET
from tests.helpers.cluster import new_key_text
from tests.helpers.npm_tools import npm_tool
from tests.helpers.prefetch import NPM_TOOLS
from tests.helpers.serve import start_serve

pytestmark = pytest.mark.cluster
CLAUDE_CODE_VERSION = NPM_TOOLS[0][1]  # the version whose requests docs/api.md describes
MODEL_ID = "tandem-demo"
API_KEY = "claude-code-test-key"
MAX_TOKENS_CAP = 64  # Claude Code asks for 32000; random weights would use them all
# Random weights never end a turn, and a turn cut at max_tokens is an error to Claude Code
# ("exceeded the output token maximum", after three tries to resume). An output schema
# (output_config.format, added to each body through CLAUDE_CODE_EXTRA_BODY) lets the grammar
# end it, as a real model's end of turn would.
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 12}},
    "required": ["answer"],
    "additionalProperties": False,
}
EXTRA_BODY = {"output_config": {"format": {"type": "json_schema", "schema": ANSWER}}}
# What `tandem serve` needs for Claude Code (docs/api.md "Using tandem from Claude Code").
SERVE_FLAGS = [
    "--parallelism", "single",
    "--model-id", MODEL_ID,
    "--model-alias", "claude-*",  # the names Claude Code uses on its own (haiku, sonnet)
    "--api-key", API_KEY,
    "--context-tokens", "8192",
    "--max-tokens-cap", str(MAX_TOKENS_CAP),
]  # fmt: skip
# One tool (Read, a rich JSON schema) beside Claude Code's own 5 KB system prompt: its whole
# default set of tools comes to about 31,000 tokens, minutes of prefill for the demo model on
# a busy CPU.
CLAUDE_FLAGS = ["--tools", "Read"]
HOP_HEADERS = {"connection", "content-length", "transfer-encoding", "accept-encoding", "host"}


@contextmanager
def recording_proxy(upstream: str) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A pass-through proxy on 127.0.0.1 that keeps each request's path, body and status."""
    records: list[dict[str, Any]] = []
    client = httpx.Client(base_url=upstream, timeout=300)

    class Forward(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.forward()

        def do_GET(self) -> None:
            self.forward()

        def do_HEAD(self) -> None:
            self.forward()

        def forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            headers = {
                name: value
                for name, value in self.headers.items()
                if name.lower() not in HOP_HEADERS
            }
            record: dict[str, Any] = {"method": self.command, "path": self.path}
            record["headers"] = headers
            record["body"] = json.loads(body) if body else None
            records.append(record)
            request = client.build_request(self.command, self.path, content=body, headers=headers)
            response = client.send(request, stream=True)
            try:
                record["status"] = response.status_code
                self.send_response(response.status_code)
                for name, value in response.headers.items():
                    if name.lower() not in HOP_HEADERS | {"content-encoding"}:
                        self.send_header(name, value)
                self.send_header("Connection", "close")
                self.end_headers()
                for chunk in response.iter_bytes():
                    self.wfile.write(chunk)
                    self.wfile.flush()
            finally:
                response.close()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", records
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
        client.close()


def test_claude_code_completes_a_turn(tmp_path: Path, demo_model_dir: Path) -> None:
    claude = npm_tool("@anthropic-ai/claude-code", CLAUDE_CODE_VERSION, "claude")
    server = start_serve(tmp_path, demo_model_dir, new_key_text(), SERVE_FLAGS)
    try:
        home, work = tmp_path / "claude-home", tmp_path / "work"
        home.mkdir()
        work.mkdir()
        with recording_proxy(server.base_url) as (url, records):
            environment = {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": str(home),
                "ANTHROPIC_BASE_URL": url,
                "ANTHROPIC_API_KEY": API_KEY,
                "ANTHROPIC_MODEL": MODEL_ID,
                "ANTHROPIC_SMALL_FAST_MODEL": MODEL_ID,
                "CLAUDE_CODE_EXTRA_BODY": json.dumps(EXTRA_BODY),
                **QUIET,
            }
            finished = subprocess.run(
                [str(claude), "-p", "hello", "--output-format", "json", *CLAUDE_FLAGS],
                cwd=work,
                env=environment,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=300,
            )
        (tmp_path / "requests.json").write_text(json.dumps(records, indent=1))
        sent = [(record["method"], record["path"], record.get("status")) for record in records]
        report = (
            f"{finished.stdout[-3000:]}\n{finished.stderr[-3000:]}\nrequests: {sent}\n"
            f"{server.log_text()[-3000:]}"
        )
        assert finished.returncode == 0, report
        result = json.loads(finished.stdout)
        assert result["is_error"] is False and result["subtype"] == "success", report
        assert result["usage"]["output_tokens"] > 0, report
        assert set(json.loads(result["result"])) == {"answer"}, report  # the model's reply
        messages = [record for record in records if record["path"].startswith("/v1/messages")]
        assert messages and all(record["status"] == 200 for record in messages), report
        turn = messages[-1]["body"]
        # What a turn of Claude Code carries, every field accepted (docs/api.md)
        assert turn["stream"] is True and turn["max_tokens"] > MAX_TOKENS_CAP
        assert [tool["name"] for tool in turn["tools"]] == ["Read"]
        assert (
            isinstance(turn["system"], list) and sum(len(b["text"]) for b in turn["system"]) > 3000
        )
        assert messages[-1]["headers"].get("x-api-key") == API_KEY
    finally:
        server.stop()
