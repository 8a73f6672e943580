"""tandem's CPU quantized kernel against mlx's own quantized matmul and float32 MKL.

Two parts, one run: each Linear shape of Qwen2.5-Coder-0.5B at 1, 8, 16 and 512 rows (median
ms of the kernel, `x @ W.T` in float32 on the BLAS, `mx.quantized_matmul`), and the imported
model's decode through mlx-lm's `generate_step` with the kernel and without.

    python -m tests.bench.bench_cpu_kernel [MODEL_DIR]   # an import of the 0.5B GGUF
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

import engines  # noqa: F401  (the BLAS before mlx)
from engines import kernels
from engines.model.packed_quantized import pack

SHAPES = ((896, 896, 5), (4864, 896, 5), (896, 4864, 8), (151936, 896, 8))  # (N, K, bits)
ROWS = (1, 8, 16, 512)
PROMPT = "Write a Python function that checks whether a number is prime."


def median_seconds(product, repeats: int) -> float:
    mx.eval(product())
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval(product())
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def row_of(kernel, weight: mx.array, quantized: tuple, bits: int, rows: int) -> str:
    """One table row: the three products' median milliseconds over `rows` rows."""
    codes, scales, biases = quantized
    x = mx.random.normal((rows, weight.shape[1]))
    ours = median_seconds(lambda: kernel.affine_matmul(x, codes, scales, biases, 32, bits), 10)
    floats = median_seconds(lambda: x @ weight.T, 10)
    theirs = "-"
    if rows <= 8 and weight.shape[0] < 10000:  # mlx's own takes seconds beyond
        seconds = median_seconds(
            lambda: mx.quantized_matmul(x, codes, scales, biases, group_size=32, bits=bits), 3
        )
        theirs = f"{1e3 * seconds:.2f}"
    n, k = weight.shape
    return f"| {n} x {k}, {bits} | {rows} | {1e3 * ours:.3f} | {1e3 * floats:.3f} | {theirs} |"


def products(kernel) -> None:
    print("| N x K, bits | rows | kernel ms | float32 ms | mlx quantized ms |")
    print("|---|---:|---:|---:|---:|")
    for n, k, bits in SHAPES:
        weight = mx.random.normal((n, k))
        quantized = mx.quantize(weight, group_size=32, bits=bits)
        mx.eval(weight, *quantized)
        for rows in ROWS:
            print(row_of(kernel, weight, quantized, bits, rows))


def decode(model_dir: str, tokens: int = 48) -> None:
    for packed in (True, False):
        model, tokenizer = load(model_dir)
        if packed:
            (model,) = pack(model)
        prompt = mx.array(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": PROMPT}], add_generation_prompt=True
            )
        )
        started = time.perf_counter()
        stamps = [
            time.perf_counter()
            for _ in generate_step(prompt, model, max_tokens=tokens if packed else 16)
        ]
        first, done, count = stamps[0], stamps[-1], len(stamps)
        name = "kernel" if packed else "mlx quantized_matmul"
        print(
            f"{name}: TTFT {first - started:.2f} s, decode {(count - 1) / (done - first):.1f} tok/s"
        )


def main() -> None:
    kernel = kernels.load()
    if kernel is None:
        sys.exit(f"the kernel is unavailable: {kernels.unavailable_reason()}")
    products(kernel)
    if len(sys.argv) > 1:
        decode(sys.argv[1])


if __name__ == "__main__":
    main()
