"""The coordinator's weight server: model files to authenticated agents, resumable by offset."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from discovery.framing import ChannelTimeout
from discovery.handshake_gate import HandshakeGate
from discovery.secure_channel import SecureChannel
from engines.weights.manifest import Manifest
from errors import ChannelError, ModelError

log = logging.getLogger(__name__)

PURPOSE = b"tandem-weights-v1"
CHUNK_BYTES = 4 * 1024 * 1024  # one sealed frame of file data
MAX_FRAME_BYTES = CHUNK_BYTES + 64 * 1024
HANDSHAKE_TIMEOUT_S = 10.0  # an agent connecting and proving the key (client side)
IDLE_TIMEOUT_S = 60.0
# One frame of file data may take this long to leave: 4 MB over a 1 Mbit/s link is 34 s.
SEND_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Offer:
    """One servable copy: its manifest and how to read a file of it from an offset."""

    manifest: Manifest
    read: Callable[[str, int], Iterator[bytes]]  # (name, offset) -> the bytes from there


def directory_offer(model_path: Path, manifest: Manifest) -> Offer:
    """The files of `manifest` as they are in `model_path`."""

    def read(name: str, offset: int) -> Iterator[bytes]:
        with open(Path(model_path) / name, "rb") as handle:
            handle.seek(offset)
            while block := handle.read(CHUNK_BYTES):
                yield block

    return Offer(manifest, read)


class WeightServer:
    """Serves model copies (a whole model, or a stage's share) to whoever proves the key.

    Requests (JSON frames): {"op": "manifest", "model": HASH} -> the manifest; {"op": "read",
    "model": HASH, "name": N, "offset": O} -> {"size": S} then S bytes from offset O in
    frames of up to CHUNK_BYTES, so a fetch broken off mid-file resumes where its .partial
    file ends. Only files named in an offered manifest are served.
    """

    def __init__(
        self,
        model_path: Path | None,
        manifest: Manifest | None,
        cluster_key: bytes,
        host: str,
    ) -> None:
        self._key = cluster_key
        self._host = host
        self._listener: socket.socket | None = None
        self._gate: HandshakeGate[SecureChannel] | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._offers: dict[str, Offer] = {}
        self.manifest = manifest  # the whole model's, when given
        self.bytes_sent: dict[str, int] = {}  # peer address -> bytes of file data sent
        if model_path is not None and manifest is not None:
            self.add(directory_offer(model_path, manifest))

    def add(self, offer: Offer) -> str:
        """Serve `offer` too; returns its content hash."""
        content_hash = offer.manifest.content_hash
        with self._lock:
            self._offers[content_hash] = offer
        return content_hash

    @property
    def port(self) -> int:
        if self._listener is None:
            raise ModelError("the weight server is not listening")
        return int(self._listener.getsockname()[1])

    def start(self) -> int:
        """Listen on an ephemeral port and serve on background threads; returns the port."""
        self._listener = socket.create_server((self._host, 0), backlog=16)
        # Agents prove the key off the accepting thread: strangers cannot hold it.
        self._gate = HandshakeGate(
            self._listener, self._prove, self._start_upload, "weight server"
        ).start()
        log.info("serving model weights to agents on %s:%d", self._host, self.port)
        return self.port

    def stop(self) -> None:
        self._stopping.set()
        if self._gate is not None:
            self._gate.stop()
        if self._listener is not None:
            self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def status(self) -> dict[str, Any]:
        with self._lock:
            sent = dict(self.bytes_sent)
            offers = {h: o.manifest.subset or "whole model" for h, o in self._offers.items()}
        whole = self.manifest
        return {
            "content_hash": whole.content_hash if whole else None,
            "total_bytes": whole.total_bytes if whole else None,
            "offers": offers,
            "sent_bytes": sent,
        }

    def _prove(self, sock: socket.socket, deadline_s: float) -> SecureChannel:
        """A gate thread: the agent proves the cluster key, or is refused."""
        return SecureChannel.server(sock, self._key, PURPOSE, deadline_s, MAX_FRAME_BYTES)

    def _start_upload(self, channel: SecureChannel, address: Any) -> None:
        channel.set_send_timeout(SEND_TIMEOUT_S)  # not the 2 s handshake deadline
        thread = threading.Thread(
            target=self._serve_one, args=(channel, address), name="weight-upload", daemon=True
        )
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _serve_one(self, channel: SecureChannel, address: Any) -> None:
        peer = f"{address[0]}:{address[1]}"
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

    def _offer(self, request: dict[str, Any]) -> Offer:
        with self._lock:
            offer = self._offers.get(str(request.get("model")))
        if offer is None:
            raise ModelError(f"no model {str(request.get('model'))[:12]} is offered here")
        return offer

    def _answer(self, channel: SecureChannel, request: dict[str, Any], peer: str) -> None:
        if request.get("op") == "manifest":
            try:
                answer = self._offer(request).manifest.to_json()
            except ModelError as error:
                answer = json.dumps({"error": str(error)})
            channel.send(answer.encode())
            return
        if request.get("op") != "read":
            raise ValueError(f"unknown weight request {request.get('op')!r}")
        offer = self._offer(request)
        entry = offer.manifest.entry(str(request["name"]))
        offset = int(request["offset"])
        if not 0 <= offset <= entry.size:
            raise ValueError(f"offset {offset} is outside {entry.name} ({entry.size} bytes)")
        remaining = entry.size - offset
        channel.send(json.dumps({"size": remaining}).encode())
        started = time.monotonic()
        for block in offer.read(entry.name, offset):
            block = block[:remaining]
            # A sealed frame holds at most CHUNK_BYTES: split larger blocks (a header).
            for start in range(0, len(block), CHUNK_BYTES):
                piece = block[start : start + CHUNK_BYTES]
                channel.send(piece)
                remaining -= len(piece)
                with self._lock:
                    self.bytes_sent[peer] = self.bytes_sent.get(peer, 0) + len(piece)
            if remaining <= 0:
                break
        if remaining:
            raise ModelError(f"{entry.name} ended {remaining} bytes early while being sent")
        elapsed = max(time.monotonic() - started, 1e-9)
        sent = entry.size - offset
        log.info(
            "sent %s of %s to %s: %.1f MB from offset %d in %.2f s (%.0f MB/s)",
            entry.name,
            offer.manifest.subset or "the model",
            peer,
            sent / 1e6,
            offset,
            elapsed,
            sent / 1e6 / elapsed,
        )
