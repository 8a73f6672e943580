"""The quantized KV cache (--kv-bits): KV bytes per token measured against the planner's
formula, and decode speed with one stream and eight, for two demo models.

Run from the project root: `python -m tests.bench.bench_kv_bits` (a few minutes). The KV
per token is the nbytes of tandem's own caches holding a long prompt, extracted from the
batch (exactly its tokens), over the tokens held; decode tok/s is tokens generated after
every stream's first token over the time they took, on the bare SingleEngine. It prints
markdown tables and writes them to docs/benchmarks.md under "## Quantized KV cache".
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from engines.core.engine_options import EngineOptions
from engines.core.request import GenerationRequest
from engines.decoding.decode_batch import DecodeBatch
from engines.decoding.sampling import make_request_sampler
from engines.model.demo import ensure_demo_model
from engines.model.demo_spec import DemoSpec
from engines.model.info import inspect_model
from engines.single.engine import SingleEngine
from tests.bench.common import markdown_table, write_section

MODELS = {
    "demo (4 layers, 4 KV heads of 32)": DemoSpec(),
    "16 layers, hidden 1024 (4 KV heads of 128)": DemoSpec(layers=16, hidden=1024),
}
MODEL_CACHE = Path(tempfile.gettempdir()) / "tandem-bench"
BITS = (0, 8, 4)
KV_PROMPT_TOKENS = 1000
PROMPT_TOKENS = 256
DECODE_TOKENS = 48
STREAMS = (1, 8)
HEADING = "## Quantized KV cache"
COMMAND = "python -m tests.bench.bench_kv_bits"


def prompt(length: int, seed: int) -> tuple[int, ...]:
    return tuple(5 + (seed * 7919 + index * 31) % 900 for index in range(length))


def kv_bytes_per_token(engine: SingleEngine, bits: int) -> float:
    """Bytes of every layer's KV per token held, from the caches tandem itself builds."""
    batch = DecodeBatch(engine.model, 1, 2048, kv_bits=bits, quantized_kv_start=0)
    request = GenerationRequest("kv", prompt(KV_PROMPT_TOKENS, 0), 2)
    batch.insert(0, request.prompt_tokens, 2, make_request_sampler(request), [])
    while (found := batch.prompt_cache(0)) is None:
        batch.step()
    caches, tokens = found
    held = caches[0].offset
    batch.close()
    return sum(cache.nbytes for cache in caches) / held


def decode_tokens_per_s(engine: SingleEngine, streams: int) -> float:
    """Tokens per second of `streams` sequences decoding together, after their first tokens."""
    for uid in range(streams):
        request = GenerationRequest(f"s{uid}", prompt(PROMPT_TOKENS, uid + 1), DECODE_TOKENS)
        engine.insert(uid, request)
    produced = {uid: 0 for uid in range(streams)}
    started, counted = None, 0
    while any(count < DECODE_TOKENS for count in produced.values()):
        outputs = engine.step()
        for output in outputs:
            produced[output.uid] += 1
        if started is not None:
            counted += len(outputs)
        elif all(produced.values()):
            started = time.perf_counter()  # every stream has its first token: decoding only
    elapsed = time.perf_counter() - started
    engine.remove(list(range(streams)))
    return counted / elapsed


def measure(name: str, spec: DemoSpec) -> list[list[str]]:
    path = ensure_demo_model(MODEL_CACHE, spec)
    facts = inspect_model(path)
    rows, baseline = [], {}
    for bits in BITS:
        # quantized from the first pass: the prompts here are under the default threshold
        engine = SingleEngine(
            path, EngineOptions(max_batch=max(STREAMS), kv_bits=bits, quantized_kv_start=0)
        )
        engine.load()
        try:
            measured = kv_bytes_per_token(engine, bits)
            shape = facts.to_shape(kv_bits=bits)
            planned = shape.kv_bytes_per_token_per_layer * shape.num_layers
            decode_tokens_per_s(engine, 1)  # warm-up
            speeds = [decode_tokens_per_s(engine, streams) for streams in STREAMS]
        finally:
            engine.close()
        baseline = baseline or {"kv": measured, "speeds": speeds}
        ratios = [speed / base for speed, base in zip(speeds, baseline["speeds"], strict=True)]
        rows.append(
            [
                name if bits == 0 else "",
                f"{bits}-bit" if bits else "off",
                f"{measured:,.0f}",
                f"{planned:,}",
                f"{baseline['kv'] / measured:.2f}x",
                *(f"{speed:.1f}" for speed in speeds),
                *(f"{ratio:.2f}x" for ratio in ratios),
            ]
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    header = [
        "model",
        "--kv-bits",
        "KV bytes/token (measured)",
        "planner's formula",
        "tokens per byte vs off",
        *(f"decode tok/s, {n} stream{'s' if n > 1 else ''}" for n in STREAMS),
        *(f"speed vs off, {n}" for n in STREAMS),
    ]
    rows = [row for name, spec in MODELS.items() for row in measure(name, spec)]
    table = markdown_table(header, rows)
    print(table)
    body = (
        f"`{COMMAND}` — with `--quantized-kv-start 0`. KV bytes per token: tandem's own caches "
        f"(every layer) holding a {KV_PROMPT_TOKENS}-token prompt, extracted from the batch, "
        "over the tokens they hold; the planner's formula is what `tandem plan` counts "
        "(float32 compute: 4-byte scales and biases). Decode: the bare SingleEngine, "
        f"{PROMPT_TOKENS}-token prompts, {DECODE_TOKENS} tokens each, timed from every "
        "stream's first token.\n\n" + table
    )
    write_section(HEADING, body)


if __name__ == "__main__":
    main()
