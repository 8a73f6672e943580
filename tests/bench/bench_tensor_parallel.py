"""Tensor-parallel benchmark: single vs tp=2 (tandem's engine and a bare mlx-lm loop), and all_sum.

Run from the project root: `python -m tests.bench.bench_tensor_parallel` (about two minutes).
Every contender decodes the same prompt greedily on the same demo model, in interleaved
rounds. The bare contender is two processes running mlx-lm's `generate_step` on the
`Model.shard` model with nothing of tandem around it: what mlx alone achieves over the same
ring backend. It prints a markdown table and writes it to docs/benchmarks.md under
"## Tensor parallel".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engines.core.request import GenerationRequest
from engines.model.demo import ensure_demo_model
from engines.model.demo_spec import DemoSpec
from engines.single.engine import SingleEngine
from engines.tensor_parallel import TensorParallelEngine, loopback_ring_specs
from tests.bench.common import (
    PROJECT_ROOT,
    Sample,
    markdown_table,
    median_of,
    run_interleaved,
    sample_from_stamps,
    stream_alone,
    write_section,
)

MODEL = DemoSpec(layers=8, hidden=512, heads=8, kv_heads=4, vocab=1024)
MODEL_CACHE = Path(tempfile.gettempdir()) / "tandem-bench"
PROMPT = "The tensor parallel benchmark measures what splitting every layer across ranks costs."
MAX_TOKENS = 64
ROUNDS = 9
ALL_SUM_ITERATIONS = 300
STARTUP_TIMEOUT_S = 180.0
HEADING = "## Tensor parallel"
COMMAND = "python -m tests.bench.bench_tensor_parallel"
BARE_FLAG = "--bare-rank"
WORKER = [sys.executable, "-m", "engines.tensor_parallel.worker"]

SINGLE = "single (SingleEngine, in-process)"
TANDEM = "tp=2 tandem TensorParallelEngine (ring)"
BARE = "tp=2 bare mlx-lm generate_step on Model.shard (ring)"


# -- the bare contender: two plain mlx-lm processes ----------------------------------------


def run_bare_rank() -> None:
    """A rank with nothing of tandem: sharded_load, then generate_step / all_sum on command."""
    spec = json.loads(sys.stdin.readline())
    directory = Path(tempfile.mkdtemp(prefix="bench-bare-"))
    hostfile = directory / "hosts.json"
    hostfile.write_text(json.dumps(spec["hosts"]))
    os.environ.update({"MLX_RANK": str(spec["rank"]), "MLX_HOSTFILE": str(hostfile)})

    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init(backend="ring", strict=True)
    model, _ = sharded_load(spec["model_path"], tensor_group=group)
    reply({"ready": True, "peak_memory_bytes": mx.get_peak_memory()})
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "generate":
            stamps: list[float] = []
            started = time.perf_counter()
            prompt = mx.array(command["prompt"], dtype=mx.uint32)
            cache = make_prompt_cache(model)
            for _ in generate_step(
                prompt, model, max_tokens=command["max_tokens"], prompt_cache=cache
            ):
                stamps.append(time.perf_counter())
            reply(
                {"started": started, "first": stamps[0], "last": stamps[-1], "tokens": len(stamps)}
            )
        elif command["cmd"] == "all_sum":
            dtype = getattr(mx, command["dtype"])
            value = mx.ones(tuple(command["shape"]), dtype=dtype)
            samples = []
            for _ in range(command["iterations"]):
                started = time.perf_counter()
                mx.eval(mx.distributed.all_sum(value, group=group))
                samples.append(time.perf_counter() - started)
            reply({"median_s": statistics.median(samples)})
        else:
            break


def reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class BareCluster:
    """Drives the two bare ranks over their stdin; rank 0 reports timings."""

    def __init__(self, model_path: Path) -> None:
        specs = loopback_ring_specs(2, model_path)
        self.ranks = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.bench.bench_tensor_parallel", BARE_FLAG],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=PROJECT_ROOT,
            )
            for _ in specs
        ]
        for process, spec in zip(self.ranks, specs, strict=True):
            self._send(process, {**spec, "model_path": str(model_path)})
        self.peaks = [self._read(process)["peak_memory_bytes"] for process in self.ranks]

    def _send(self, process: subprocess.Popen[str], message: dict[str, Any]) -> None:
        assert process.stdin is not None
        process.stdin.write(json.dumps(message) + "\n")
        process.stdin.flush()

    def _read(self, process: subprocess.Popen[str]) -> dict[str, Any]:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"bare rank pid {process.pid} exited ({process.wait()})")
        return json.loads(line)

    def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        for process in self.ranks:
            self._send(process, message)
        answers = [self._read(process) for process in self.ranks]
        return answers[0]

    def measure(self, prompt: list[int]) -> Sample:
        timing = self.ask({"cmd": "generate", "prompt": prompt, "max_tokens": MAX_TOKENS})
        return sample_from_stamps(
            timing["started"], timing["first"], timing["last"], timing["tokens"]
        )

    def all_sum_s(self, shape: list[int], dtype: str) -> float:
        command = {
            "cmd": "all_sum",
            "shape": shape,
            "dtype": dtype,
            "iterations": ALL_SUM_ITERATIONS,
        }
        return self.ask(command)["median_s"]

    def close(self) -> None:
        for process in self.ranks:
            if process.poll() is None:
                try:
                    self._send(process, {"cmd": "quit"})
                except OSError:
                    pass
        for process in self.ranks:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# -- tandem's contenders --------------------------------------------------------------------


def time_engine(engine: Any, prompt: list[int]) -> Sample:
    request = GenerationRequest("bench", tuple(prompt), MAX_TOKENS)
    stamps: list[float] = []
    started = time.perf_counter()
    for _ in stream_alone(engine, request):
        stamps.append(time.perf_counter())
    return sample_from_stamps(started, stamps[0], stamps[-1], len(stamps))


class TandemCluster:
    """TensorParallelEngine with its rank 1 started the way an agent would."""

    def __init__(self, model_path: Path) -> None:
        specs = loopback_ring_specs(2, model_path)
        self.rank1 = subprocess.Popen(
            WORKER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=PROJECT_ROOT
        )
        assert self.rank1.stdin is not None
        self.rank1.stdin.write((json.dumps(specs[1]) + "\n").encode())
        self.rank1.stdin.flush()
        self.engine = TensorParallelEngine(model_path, specs[0], load_timeout_s=STARTUP_TIMEOUT_S)
        try:
            self.engine.load()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.engine.close()
        try:
            self.rank1.wait(10)
        except subprocess.TimeoutExpired:
            self.rank1.kill()
            self.rank1.wait()


# -- report -----------------------------------------------------------------------------------


def render(
    samples: dict[str, list[Sample]],
    peaks: dict[str, list[int]],
    hidden_all_sum_s: float,
    sync_all_sum_s: float,
    spec: Any,
    load_averages: tuple[float, float],
) -> str:
    sync_every = spec.sync_every
    single_rate = median_of(samples[SINGLE], lambda s: s.decode_tokens_per_s)
    rows = []
    for name, runs in samples.items():
        rate = median_of(runs, lambda s: s.decode_tokens_per_s)
        first = median_of(runs, lambda s: s.first_token_s)
        best = max(sample.decode_tokens_per_s for sample in runs)
        memory = " / ".join(f"{peak / 2**20:.1f}" for peak in peaks[name])
        rows.append(
            [
                name,
                f"{first * 1e3:.1f}",
                f"{rate:.1f}",
                f"{best:.1f}",
                f"{1e3 / rate:.1f}",
                f"{rate / single_rate:.2f}x",
                memory,
            ]
        )
    header = [
        "configuration",
        "time to first token (ms)",
        "decode (tokens/s)",
        "best decode (tokens/s)",
        "ms / token",
        "vs single",
        "peak mlx memory per rank (MiB)",
    ]
    tandem_rate = median_of(samples[TANDEM], lambda s: s.decode_tokens_per_s)
    bare_rate = median_of(samples[BARE], lambda s: s.decode_tokens_per_s)
    tandem_best = max(sample.decode_tokens_per_s for sample in samples[TANDEM])
    bare_best = max(sample.decode_tokens_per_s for sample in samples[BARE])
    collectives = 2 * MODEL.layers
    per_token_s = 1 / tandem_rate
    lines = [
        f"Demo model: llama, {MODEL.layers} layers, hidden {MODEL.hidden}, {MODEL.heads} heads "
        f"({MODEL.kv_heads} KV), float32; prompt {len(PROMPT.split())} words, {MAX_TOKENS} "
        f"tokens decoded greedily; medians of {ROUNDS} interleaved rounds after a warm-up. "
        "All ranks share this machine's cores over 127.0.0.1.",
        "",
        markdown_table(header, rows),
        f"- tandem vs bare mlx-lm over the same ring: decode {tandem_rate / bare_rate:.2f}x "
        f"(medians), {tandem_best / bare_best:.2f}x (best runs).",
        f"- Ring `all_sum` of one activation ({MODEL.hidden} float32, "
        f"{4 * MODEL.hidden} bytes): {hidden_all_sum_s * 1e6:.0f} µs (median of "
        f"{ALL_SUM_ITERATIONS}). A token needs {collectives} of them (2 per layer): "
        f"{collectives * hidden_all_sum_s * 1e3:.1f} ms, "
        f"{collectives * hidden_all_sum_s / per_token_s:.0%} of tandem's tp ms / token.",
        f"- tandem's sync point (one `all_sum` of 3 int32 every {sync_every} tokens): "
        f"{sync_all_sum_s * 1e6:.0f} µs, {sync_all_sum_s / sync_every * 1e3:.2f} ms per token "
        f"amortized ({sync_all_sum_s / sync_every / per_token_s:.1%}).",
        "- tandem's time to first token includes the idle wait of the other ranks (while "
        f"idle they meet rank 0 in a header broadcast at most `heartbeat_s` = "
        f"{spec.heartbeat_s * 1e3:.0f} ms apart instead of busy-polling inside the ring's "
        "recv) and the stdin/stdout pipe to rank 0.",
        "- Peak memory is measured right after loading. tandem evaluates the sharded weights "
        "one layer at a time; the bare ranks use `mlx_lm.utils.sharded_load`, whose single "
        "`mx.eval` briefly holds the unsliced tensors.",
        f"- Load average (1 min) at start / end: {load_averages[0]:.1f} / "
        f"{load_averages[1]:.1f}. The ranks' ring threads busy-poll while they wait, so on 2 "
        "cores any other load swings single runs by several x; the medians of interleaved "
        "rounds and the best runs are the numbers to compare.",
        "",
        f"Command: `{COMMAND}`",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(BARE_FLAG, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    arguments = parser.parse_args()
    if arguments.bare_rank:
        run_bare_rank()
        return

    import mlx.core as mx

    load_at_start = os.getloadavg()[0]
    model_path = ensure_demo_model(MODEL_CACHE, MODEL)
    mx.reset_peak_memory()
    single = SingleEngine(model_path)
    single.load()
    single_peak = mx.get_peak_memory()
    prompt = list(single.tokenizer.encode(PROMPT))
    tandem = TandemCluster(model_path)
    bare = BareCluster(model_path)
    try:
        expected = list(stream_alone(single, GenerationRequest("check", tuple(prompt), MAX_TOKENS)))
        got = list(
            stream_alone(tandem.engine, GenerationRequest("check", tuple(prompt), MAX_TOKENS))
        )
        if got != expected:
            raise RuntimeError(
                "tp output differs from single: the benchmark would compare apples to pears"
            )
        samples = run_interleaved(
            {
                SINGLE: lambda: time_engine(single, prompt),
                TANDEM: lambda: time_engine(tandem.engine, prompt),
                BARE: lambda: bare.measure(prompt),
            },
            rounds=arguments.rounds,
        )
        hidden_s = statistics.median(
            bare.all_sum_s([1, 1, MODEL.hidden], "float32") for _ in range(arguments.rounds)
        )
        sync_s = statistics.median(bare.all_sum_s([3], "int32") for _ in range(arguments.rounds))
        peaks = {
            SINGLE: [single_peak],
            TANDEM: tandem.engine.ready["rank_peak_memory_bytes"],
            BARE: bare.peaks,
        }
        spec = tandem.engine.spec
    finally:
        tandem.close()
        bare.close()
        single.close()
    table = render(samples, peaks, hidden_s, sync_s, spec, (load_at_start, os.getloadavg()[0]))
    sys.stdout.write(table)
    write_section(HEADING, table)


if __name__ == "__main__":
    main()
