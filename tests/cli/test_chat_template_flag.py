"""`tandem serve --chat-template FILE`: a file it cannot read stops serve in one line before
any model loads; a readable one reaches the API, whose chats to a base model it then renders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers.cluster import LOOPBACK, REPO_ROOT, child_env
from tests.helpers.demo_models import BASE_CHAT_RENDERED, BASE_CHAT_TEMPLATE
from tests.helpers.serve import http_port, start_serve

KEY = "tandem-" + "A" * 43


def test_an_unreadable_template_file_stops_serve_before_the_model_loads(tmp_path: Path) -> None:
    """The model named does not exist either: the template's error comes first."""
    missing = tmp_path / "missing.jinja"
    command = [sys.executable, "-m", "cli.main", "serve", "--model", str(tmp_path / "no-model")]
    command += ["--chat-template", str(missing), "--cluster-key", KEY]
    command += ["--host", LOOPBACK, "--port", str(http_port(LOOPBACK))]
    command += ["--state-dir", str(tmp_path / "state"), "--cache-dir", str(tmp_path / "cache")]
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"tandem: error: --chat-template {missing}: cannot read it (No such file or directory)"
    ]


@pytest.mark.cluster
def test_serve_renders_a_base_models_chats_with_the_template(
    base_model_dir: Path, tmp_path: Path
) -> None:
    """The chat's prompt is the template's rendering: as many tokens, and the same greedy
    answer, as the rendered text sent to /v1/completions."""
    template = tmp_path / "chat.jinja"
    template.write_text(BASE_CHAT_TEMPLATE)
    flags = ["--parallelism", "single", "--model-id", "base", "--chat-template", str(template)]
    server = start_serve(tmp_path, base_model_dir, KEY, flags)
    ask = {"model": "base", "max_tokens": 8, "temperature": 0}
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            chat = client.post(
                "/v1/chat/completions",
                json={**ask, "messages": [{"role": "user", "content": "Hello there"}]},
            )
            completion = client.post("/v1/completions", json={**ask, "prompt": BASE_CHAT_RENDERED})
    finally:
        server.stop()
    assert chat.status_code == 200, chat.text
    assert completion.status_code == 200, completion.text
    prompt_tokens = completion.json()["usage"]["prompt_tokens"]
    assert chat.json()["usage"]["prompt_tokens"] == prompt_tokens
    answer = chat.json()["choices"][0]["message"]["content"]
    assert answer == completion.json()["choices"][0]["text"]
