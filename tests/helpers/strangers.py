"""Strangers on the LAN for tests and benchmarks: connections that are silent, trickle, or send
a hello they cannot back with the key, held open against a cluster's ports; and streams whose
inter-token gaps show whether anything waited on them."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

from openai import OpenAI

from tests.helpers.serve import ServeProcess

PROMPT = "Strangers knock, and the pipeline keeps"


def open_strangers(port: int, per_kind: int = 24) -> list[socket.socket]:
    """Silent ones, ones trickling a hello a byte at a time, ones sending a well-formed hello
    of the right purpose without the key behind it."""
    strangers = []
    for _ in range(per_kind):
        strangers.append(socket.create_connection(("127.0.0.1", port)))  # silent
        trickler = socket.create_connection(("127.0.0.1", port))
        trickler.sendall(struct.pack(">I", 64)[:1])  # the first byte of a frame header
        strangers.append(trickler)
        hello = socket.create_connection(("127.0.0.1", port))
        hello.sendall(struct.pack(">I", 4) + b"TDM1")  # looks like a start, proves nothing
        strangers.append(hello)
    return strangers


class Strangers:
    """Keeps `per_kind` silent, trickling and unproven-hello connections open against each of
    `ports` (and `idle_http` idle ones against the HTTP API, a few trickling a request line),
    reopening the ones the cluster drops, until stopped."""

    def __init__(
        self, ports: list[int], http_port: int, per_kind: int = 12, idle_http: int = 200
    ) -> None:
        self.ports = ports
        self.http_port = http_port
        self.per_kind = per_kind
        self.idle_http_count = idle_http
        self.socks: dict[tuple[int, str, int], socket.socket] = {}
        self.idle_http: list[socket.socket] = []
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Strangers:
        for _ in range(self.idle_http_count):
            self.idle_http.append(socket.create_connection(("127.0.0.1", self.http_port)))
        self._top_up()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in [*self.socks.values(), *self.idle_http]:
            sock.close()

    def _open(self, port: int, kind: str) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=2)
        if kind == "hello":  # a frame that starts like a handshake and proves nothing
            sock.sendall(struct.pack(">I", 40) + b"TDM1" + os.urandom(20))
        return sock

    def _top_up(self) -> None:
        for port in self.ports:
            for kind in ("silent", "trickle", "hello"):
                for index in range(self.per_kind):
                    slot = (port, kind, index)
                    if slot not in self.socks:
                        try:
                            self.socks[slot] = self._open(port, kind)
                        except OSError:
                            continue
                        self.reopened += 1

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            for slot, sock in list(self.socks.items()):
                try:
                    if slot[1] == "trickle":
                        sock.send(b"\x00")  # a frame header, one byte at a time
                    elif sock.recv(1, socket.MSG_DONTWAIT) == b"":
                        raise OSError("closed by the cluster")
                except BlockingIOError:
                    continue
                except OSError:
                    sock.close()
                    del self.socks[slot]
            for sock in self.idle_http[:4]:
                try:
                    sock.send(b"G")  # slowloris: a request line that never ends
                except OSError:
                    pass
            self._top_up()


def stream_all(
    server: ServeProcess, streams: int = 4, max_tokens: int = 48, model: str = "demo"
) -> tuple[list[str], list[float]]:
    """`streams` greedy streams at once: their texts and every gap between two tokens."""
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60, max_retries=0)
    texts: list[str] = [""] * streams
    gaps: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one(index: int) -> None:
        last = None
        try:
            for chunk in client.completions.create(
                model=model, prompt=PROMPT + f" {index}", max_tokens=max_tokens, temperature=0,
                stream=True,
            ):
                now = time.monotonic()
                with lock:
                    texts[index] += chunk.choices[0].text if chunk.choices else ""
                    if last is not None:
                        gaps.append(now - last)
                last = now
        except Exception as error:  # noqa: BLE001 - reported below, with the others
            errors.append(str(error))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert not errors, errors
    return texts, gaps
