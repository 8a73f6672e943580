"""`tandem serve --kv-bits 4` end to end: the plan and the engine say so, the prefix cache (its
disk tier included) hits with quantized entries, and the answers equal a cold quantized server."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import OpenAI

from tests.helpers.serve import ServeProcess, start_serve

pytestmark = pytest.mark.cluster

KEY = "tandem-" + "A" * 43
SYSTEM = "You are a careful assistant who answers in full sentences. " * 20


def chat_two_turns(server: ServeProcess) -> tuple[list[str], list[int]]:
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=120)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "One?"}]
    texts, cached = [], []
    for follow_up in ("Two?", None):
        reply = client.chat.completions.create(
            model="demo", messages=messages, max_tokens=16, temperature=0
        )
        texts.append(reply.choices[0].message.content)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        if follow_up is not None:
            messages += [
                {"role": "assistant", "content": texts[-1]},
                {"role": "user", "content": follow_up},
            ]
    return texts, cached


def test_serve_with_kv_bits_4_plans_serves_and_caches_quantized(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    base = ["--parallelism", "single", "--model-id", "demo", "--kv-bits", "4"]
    cold = start_serve(tmp_path, demo_model_dir, KEY, [*base, "--prefix-cache-bytes", "0"])
    try:
        cold_texts, cold_cached = chat_two_turns(cold)
    finally:
        cold.stop()
    assert cold_cached == [0, 0]

    # quantized, a turn's entry (~230 KB) overflows 64 KB of memory: every entry goes to disk
    disk = ["--prefix-cache-bytes", "64K", "--prefix-cache-disk-bytes", "1G"]
    server = start_serve(tmp_path, demo_model_dir, KEY, [*base, *disk], name="hot")
    try:
        cluster = server.cluster()
        texts, cached = chat_two_turns(server)
        status = server.cluster()["engine"]
    finally:
        server.stop()
    plan = cluster["plan"]
    assert (plan["kv_bits"], plan["kv_bytes_per_token"]) == (4, 4 * 2 * 4 * (16 + 2 * 4))
    assert status["kv_bits"] == 4 and status["prefix_cache"]["disk_hits"] >= 1
    assert cached[1] > len(SYSTEM) // 10 and texts == cold_texts
    assert list((tmp_path / "cache" / "prefix-cache").rglob("single-kv4/*.safetensors"))
