"""Start and stop a real `tandem serve` process on 127.0.0.1 for end-to-end cluster tests."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers.cluster import LOOPBACK, REPO_ROOT, child_env

READY_TIMEOUT_S = 90.0


@dataclass
class ServeProcess:
    """One `tandem serve`; its output goes to log_path. stop() always reaps it."""

    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def get(self, path: str) -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=5) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"{}")

    def wait_healthy(self, timeout_s: float = READY_TIMEOUT_S) -> ServeProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                raise RuntimeError(f"serve exited with {code}:\n{self.log_text()}")
            try:
                status, body = self.get("/health")
                if status == 200 and body.get("status") == "ok":
                    return self
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"serve not healthy within {timeout_s} s:\n{self.log_text()}")

    def cluster(self) -> dict[str, Any]:
        return self.get("/v1/cluster")[1]

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait(timeout=timeout_s)


def http_port(host: str) -> int:
    """A free port below the kernel's ephemeral range: the server binds it only once its
    engine is up, and meanwhile a port handed out by the OS (a pipeline's return listener,
    any client) must not be able to take it."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = random.randrange(max(low // 2, 1024), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low} on {host}")


def start_serve(
    tmp: Path,
    model: Path,
    cluster_key: str,
    args: Sequence[str] = (),
    *,
    wait: bool = True,
    name: str = "serve",
) -> ServeProcess:
    """`tandem serve` on loopback with its own state dir; waits for /health unless told not to."""
    port = http_port(LOOPBACK)
    log_path = tmp / f"{name}.log"
    command = [
        sys.executable,
        "-m",
        "cli.main",
        "serve",
        "--model",
        str(model),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--interface",
        LOOPBACK,
        "--cluster-key",
        cluster_key,
        "--state-dir",
        str(tmp / f"{name}-state"),
        "--cache-dir",
        str(tmp / "cache"),
        "--discovery-timeout",
        "2",
        "--lost-after",
        "3",
        *args,
    ]
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=child_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    server = ServeProcess(process, port, log_path)
    if wait:
        try:
            server.wait_healthy()
        except BaseException:
            server.stop()
            raise
    return server


LONG_SYSTEM = "You are a careful assistant who answers in full sentences. " * 20


def chat_two_turns(
    server: ServeProcess, max_tokens: int, model_id: str = "demo"
) -> tuple[list[str], list[int]]:
    """Two greedy turns of one conversation with a long system prompt, through the openai
    client: the texts and each turn's cached prompt tokens."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=120)
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "One?"}]
    texts, cached = [], []
    for follow_up in ("Two?", None):
        reply = client.chat.completions.create(
            model=model_id, messages=messages, max_tokens=max_tokens, temperature=0
        )
        texts.append(reply.choices[0].message.content)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        if follow_up is not None:
            messages += [
                {"role": "assistant", "content": texts[-1]},
                {"role": "user", "content": follow_up},
            ]
    return texts, cached
