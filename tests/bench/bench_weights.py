"""Weight transfer benchmark: tandem's verified, encrypted fetch vs a raw loopback TCP copy.

Run from the project root: `python -m tests.bench.bench_weights [--megabytes 256]` (under a
minute). Both copy the same model file from one directory to another over 127.0.0.1 and
fsync it; the raw copy is `socket.sendfile` into a plain `recv` loop, tandem's is
WeightServer -> fetch_model (sealed 4 MB frames, SHA-256 on arrival, manifest hashed before
timing). It prints a markdown section and writes it to docs/benchmarks.md under
"## Weight transfer".
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from discovery.cluster_key import generate_key
from engines.weights.fetch import fetch_model
from engines.weights.manifest import build_manifest
from engines.weights.server import WeightServer
from tests.bench.common import markdown_table, write_section

HOST = "127.0.0.1"
ROUNDS = 3


def make_model(root: Path, megabytes: int) -> Path:
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}\n')
    with open(model / "model.safetensors", "wb") as handle:
        for _ in range(megabytes):
            handle.write(os.urandom(1024 * 1024))
    return model


def raw_copy(source: Path, target: Path) -> float:
    """Seconds to send `source` over loopback TCP into `target` and fsync it."""
    listener = socket.create_server((HOST, 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        connection, _ = listener.accept()
        with connection, open(source, "rb") as handle:
            connection.sendfile(handle)

    sender = threading.Thread(target=serve)
    started = time.perf_counter()
    sender.start()
    with socket.create_connection((HOST, port)) as sock, open(target, "wb") as handle:
        while block := sock.recv(1024 * 1024):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    elapsed = time.perf_counter() - started
    sender.join()
    listener.close()
    return elapsed


def tandem_fetch(server: WeightServer, key: bytes, cache: Path) -> float:
    shutil.rmtree(cache, ignore_errors=True)
    started = time.perf_counter()
    fetch_model(HOST, server.port, key, server.manifest.content_hash, cache)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-bench-weights-") as directory:
        root = Path(directory)
        model = make_model(root, args.megabytes)
        size = sum(file.stat().st_size for file in model.iterdir())
        key = generate_key()
        server = WeightServer(model, build_manifest(model), key, HOST)
        server.start()
        raw, fetched = [], []
        try:
            for _ in range(ROUNDS):
                raw.append(raw_copy(model / "model.safetensors", root / "raw.bin"))
                fetched.append(tandem_fetch(server, key, root / "cache"))
        finally:
            server.stop()
    raw_s, fetch_s = statistics.median(raw), statistics.median(fetched)
    rows = [
        ["raw loopback TCP (sendfile)", f"{raw_s:.2f}", f"{size / 1e6 / raw_s:.0f}"],
        ["tandem fetch (sealed, SHA-256)", f"{fetch_s:.2f}", f"{size / 1e6 / fetch_s:.0f}"],
    ]
    body = (
        f"`python -m tests.bench.bench_weights --megabytes {args.megabytes}`: one "
        f"{size / 1e6:.0f} MB model copied over 127.0.0.1 into a fresh directory and fsynced, "
        f"median of {ROUNDS} rounds.\n\n"
        + markdown_table(["copy", "seconds", "MB/s"], rows)
        + f"\ntandem's fetch runs at {raw_s / fetch_s:.0%} of the raw copy's rate (the rest is "
        "sealing each 4 MB frame, opening it, and hashing the file on arrival; here both "
        "ends share one Python process, on a 2-core machine shared with other jobs).\n"
    )
    print(body)
    write_section("## Weight transfer", body)


if __name__ == "__main__":
    main()
