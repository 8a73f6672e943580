"""Headless Debian chromium driven over the DevTools protocol (websocket-client), loopback only."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import websocket

from engines.cluster.launch import free_port
from tests.helpers.cluster import LOOPBACK

BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome")
START_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 15.0
# Nothing but loopback: no name resolves, no background service phones home.
OFFLINE_FLAGS = (
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--no-first-run",
    "--no-default-browser-check",
    "--no-pings",
)


def find_browser() -> str | None:
    for name in BROWSER_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless chromium with one page; collects console errors and exceptions."""

    def __init__(self, binary: str, profile: Path, width: int = 1100, height: int = 1400) -> None:
        self.port = free_port(LOOPBACK)
        self.log_path = profile.with_suffix(".log")
        command = [
            binary,
            "--headless=new",
            "--no-sandbox",  # tests run as root in containers
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            f"--remote-debugging-address={LOOPBACK}",
            f"--remote-debugging-port={self.port}",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            *OFFLINE_FLAGS,
            "about:blank",
        ]
        with open(self.log_path, "w") as log:
            # A session of its own: close() stops chromium's helper processes with it.
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.console_errors: list[str] = []
        self._next_id = 0
        try:
            self._socket = websocket.create_connection(
                self._page_socket_url(), timeout=CALL_TIMEOUT_S, suppress_origin=True
            )
            for domain in ("Runtime", "Log", "Page"):
                self.call(f"{domain}.enable")
        except BaseException:
            self.close()
            raise

    def _page_socket_url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        url = f"http://{LOOPBACK}:{self.port}/json/list"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited: {self.log_path.read_text(errors='replace')}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    targets = json.loads(response.read())
                pages = [t for t in targets if t.get("type") == "page"]
                if pages:
                    return pages[0]["webSocketDebuggerUrl"]
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"chromium's DevTools did not answer within {START_TIMEOUT_S} s")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one DevTools command and return its result; events seen meanwhile are kept."""
        self._next_id += 1
        call_id = self._next_id
        self._socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while time.monotonic() < deadline:
            message = json.loads(self._socket.recv())
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method} failed: {message['error']}")
                return message.get("result", {})
            self._observe(message)
        raise TimeoutError(f"{method} got no answer within {CALL_TIMEOUT_S} s")

    def _observe(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            texts = [str(arg.get("value", arg.get("description", ""))) for arg in params["args"]]
            self.console_errors.append("console: " + " ".join(texts))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            exception = details.get("exception", {}).get("description") or details.get("text")
            self.console_errors.append(f"exception: {exception}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.console_errors.append(f"log: {entry.get('text')} {entry.get('url', '')}")

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def wait_until(self, expression: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"{expression!r} stayed false for {timeout_s} s")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    def close(self) -> None:
        socket = getattr(self, "_socket", None)
        if socket is not None:
            try:
                self.call("Browser.close")
            except Exception:  # noqa: BLE001 - the process is stopped below either way
                pass
            socket.close()
        group = self.process.pid  # the session this browser leads: nothing else is in it
        self._signal_group(group, signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._signal_group(group, signal.SIGKILL)  # helpers that outlived the main process
        self.process.wait(timeout=10)

    @staticmethod
    def _signal_group(group: int, signum: int) -> None:
        try:
            os.killpg(group, signum)
        except (ProcessLookupError, PermissionError):
            pass
