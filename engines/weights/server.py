"""The coordinator's weight server: model files to authenticated agents, resumable by offset."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

from discovery.framing import ChannelTimeout
from discovery.secure_channel import SecureChannel
from planner.errors import ChannelError, ModelError

from .manifest import Manifest

log = logging.getLogger(__name__)

PURPOSE = b"tandem-weights-v1"
CHUNK_BYTES = 4 * 1024 * 1024  # one sealed frame of file data
MAX_REQUEST_BYTES = 64 * 1024  # requests are small JSON objects
MAX_FRAME_BYTES = CHUNK_BYTES + 64 * 1024
HANDSHAKE_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 60.0


class WeightServer:
    """Serves one model's manifest and files to whoever proves the cluster key.

    Requests (JSON frames): {"op": "manifest"} -> the manifest; {"op": "read", "name": N,
    "offset": O} -> {"size": S} then S bytes from offset O in frames of CHUNK_BYTES, so a
    fetch broken off mid-file resumes where its .partial file ends. Only files named in the
    manifest are served.
    """

    def __init__(self, model_path: Path, manifest: Manifest, cluster_key: bytes, host: str) -> None:
        self.model_path = Path(model_path)
        self.manifest = manifest
        self._key = cluster_key
        self._host = host
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.bytes_sent: dict[str, int] = {}  # peer address -> bytes of file data sent

    @property
    def port(self) -> int:
        if self._listener is None:
            raise ModelError("the weight server is not listening")
        return int(self._listener.getsockname()[1])

    def start(self) -> int:
        """Listen on an ephemeral port and serve on background threads; returns the port."""
        self._listener = socket.create_server((self._host, 0), backlog=16)
        self._listener.settimeout(0.5)
        thread = threading.Thread(target=self._accept_loop, name="weight-server", daemon=True)
        thread.start()
        self._threads.append(thread)
        log.info(
            "serving model %s (%.1f MB) to agents on %s:%d",
            self.manifest.content_hash[:12],
            self.manifest.total_bytes / 1e6,
            self._host,
            self.port,
        )
        return self.port

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def status(self) -> dict[str, Any]:
        with self._lock:
            sent = dict(self.bytes_sent)
        return {
            "content_hash": self.manifest.content_hash,
            "total_bytes": self.manifest.total_bytes,
            "sent_bytes": sent,
        }

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                sock, address = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(
                target=self._serve_one, args=(sock, address), name="weight-upload", daemon=True
            )
            thread.start()
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _serve_one(self, sock: socket.socket, address: Any) -> None:
        peer = f"{address[0]}:{address[1]}"
        try:
            channel = SecureChannel.server(
                sock, self._key, PURPOSE, HANDSHAKE_TIMEOUT_S, MAX_FRAME_BYTES
            )
        except ChannelError as error:
            log.warning("weight request from %s refused: %s", peer, error)
            return
        with channel:
            try:
                while not self._stopping.is_set():
                    try:
                        request = json.loads(channel.recv(IDLE_TIMEOUT_S))
                    except ChannelTimeout:
                        return
                    self._answer(channel, request, peer)
            except (ChannelError, ModelError, ValueError, KeyError, TypeError, OSError) as error:
                log.info("weight transfer to %s ended: %s", peer, error)

    def _answer(self, channel: SecureChannel, request: dict[str, Any], peer: str) -> None:
        if request.get("op") == "manifest":
            channel.send(self.manifest.to_json().encode())
            return
        if request.get("op") != "read":
            raise ValueError(f"unknown weight request {request.get('op')!r}")
        entry = self.manifest.entry(str(request["name"]))
        offset = int(request["offset"])
        if not 0 <= offset <= entry.size:
            raise ValueError(f"offset {offset} is outside {entry.name} ({entry.size} bytes)")
        remaining = entry.size - offset
        channel.send(json.dumps({"size": remaining}).encode())
        started = time.monotonic()
        with open(self.model_path / entry.name, "rb") as handle:
            handle.seek(offset)
            while remaining > 0:
                block = handle.read(min(CHUNK_BYTES, remaining))
                if not block:
                    raise ModelError(f"{entry.name} shrank while being sent")
                channel.send(block)
                remaining -= len(block)
                with self._lock:
                    self.bytes_sent[peer] = self.bytes_sent.get(peer, 0) + len(block)
        elapsed = max(time.monotonic() - started, 1e-9)
        sent = entry.size - offset
        log.info(
            "sent %s to %s: %.1f MB from offset %d in %.2f s (%.0f MB/s)",
            entry.name,
            peer,
            sent / 1e6,
            offset,
            elapsed,
            sent / 1e6 / elapsed,
        )
