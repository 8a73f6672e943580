"""Flag helpers: every flag has a TANDEM_* environment twin, read here and nowhere deeper."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any


def env_default(name: str, default: Any = None, cast: Callable[[str], Any] = str) -> Any:
    """The value of TANDEM_<NAME> cast to the flag's type, or `default` when unset."""
    raw = os.environ.get(f"TANDEM_{name}")
    if raw is None or raw == "":
        return default
    try:
        return cast(raw)
    except ValueError as error:
        raise SystemExit(f"tandem: error: TANDEM_{name}={raw!r} is invalid: {error}") from None


def add_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    default: Any = None,
    cast: Callable[[str], Any] = str,
    help: str,
    **kwargs: Any,
) -> None:
    """Add `--flag` whose default comes from TANDEM_FLAG (dashes become underscores)."""
    env_name = flag.lstrip("-").replace("-", "_").upper()
    parser.add_argument(
        flag,
        default=env_default(env_name, default, cast),
        type=cast,
        help=f"{help} [env TANDEM_{env_name}; default {default}]",
        **kwargs,
    )


def add_key_flags(parser: argparse.ArgumentParser) -> None:
    """The cluster key flags shared by serve, join and peers."""
    add_flag(parser, "--cluster-key", help="the shared cluster key text (tandem-...)")
    add_flag(parser, "--cluster-key-file", help="a file holding the cluster key")


def add_interface_flag(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser,
        "--interface",
        help="address zeroconf and the control port bind to (127.0.0.1 keeps everything local)",
    )


def add_memory_budget_flag(parser: argparse.ArgumentParser) -> None:
    """The run-time memory monitor's budget, shared by serve and join."""
    add_flag(
        parser,
        "--memory-budget",
        help="memory tiers (ok/warn/critical) treat this node as having at most this much, "
        "tandem's own processes counted against it, e.g. 8G (default: the machine's memory)",
    )


def add_blas_flags(parser: argparse.ArgumentParser) -> None:
    """Which BLAS mlx runs on here and in every worker started from here (Linux CPU)."""
    add_flag(
        parser,
        "--blas",
        default="auto",
        choices=["auto", "reference"],
        help="auto: an optimized BLAS under mlx on Linux; reference: mlx as installed",
    )
    add_flag(parser, "--blas-threads", default=0, cast=int, help="BLAS threads (0: every core)")
    add_flag(
        parser,
        "--gemm-layout",
        default="auto",
        choices=["auto", "off"],
        help="auto: Linear layers over 16-48 rows computed weights first where MKL measured "
        "that faster at load; off: every product as mlx computes it",
    )
    add_flag(
        parser,
        "--cpu-kernels",
        default="auto",
        choices=["auto", "off"],
        help="auto: quantized layers on tandem's CPU kernel (x86-64 Linux, built once per "
        "machine); off: mlx's own quantized matmul",
    )


def apply_blas_flags(args: argparse.Namespace) -> None:
    """Hand the choice to engines/core/blas.py through its environment variables, which every
    worker process inherits; must run before the first import of anything under engines/."""
    os.environ["TANDEM_BLAS"] = args.blas
    os.environ["TANDEM_GEMM_LAYOUT"] = args.gemm_layout  # engines/model/gemm_layout.py
    os.environ["TANDEM_CPU_KERNELS"] = args.cpu_kernels  # engines/kernels
    if args.blas_threads > 0:
        os.environ["TANDEM_BLAS_THREADS"] = str(args.blas_threads)


def add_max_batch_flag(parser: argparse.ArgumentParser) -> None:
    """--max-batch, shared by serve and plan: unset (None) lets the planner shrink the batch."""
    from planner.memory import DEFAULT_MAX_BATCH

    parser.add_argument(
        "--max-batch",
        type=int,
        default=env_default("MAX_BATCH", None, int),
        help="sequences decoded together (continuous batching). Unset: up to "
        f"{DEFAULT_MAX_BATCH}, as many as the memory holds with --context-tokens of KV each "
        "(more requests wait in the queue); given: that many, or refused when they do not "
        f"fit [env TANDEM_MAX_BATCH; default {DEFAULT_MAX_BATCH} or as many as fit]",
    )


def max_batch_from(value: int | None) -> tuple[int, bool]:
    """--max-batch: the batch to plan, and whether the planner may shrink it to fit (unset)."""
    from errors import ConfigError
    from planner.memory import DEFAULT_MAX_BATCH

    if value is None:
        return DEFAULT_MAX_BATCH, True
    if value < 1:
        raise ConfigError(f"--max-batch must be at least 1, got {value}")
    return value, False


def add_planning_flags(parser: argparse.ArgumentParser) -> None:
    """Planning choices `serve` acts on and `tandem plan` must plan alike."""
    from planner.memory import DEFAULT_QUANTIZED_KV_START

    add_flag(
        parser,
        "--prefix-cache-bytes",
        default="auto",
        help="KV kept for prompt reuse, whole model (e.g. 2G; 0 turns it off; auto: half "
        "of the memory the tightest node has left after weights and the batch's KV)",
    )
    add_flag(
        parser,
        "--kv-bits",
        default="off",
        metavar="{8,4,off}",
        help="quantize every engine's KV cache (prefix cache included) to 8 or 4 bits, as "
        "mlx-lm does, once a sequence holds --quantized-kv-start tokens: with bfloat16 heads "
        "of 128, 1.9x / 3.6x the tokens of KV in the same memory, which the plan counts; off "
        "keeps it in the compute precision",
    )
    add_flag(
        parser,
        "--quantized-kv-start",
        default=str(DEFAULT_QUANTIZED_KV_START),
        metavar="TOKENS",
        help="with --kv-bits, a sequence's KV stays in full precision until a prefill chunk "
        "or decode step leaves it holding this many tokens, then all of it is quantized "
        "(mlx_lm.server's default; 0: after the first chunk)",
    )
    add_flag(
        parser,
        "--cpu-float32",
        default="auto",
        choices=["auto", "off"],
        help="on the CPU, compute half-precision models in float32 where the memory allows",
    )
    add_flag(
        parser,
        "--measure-speeds",
        default="auto",
        choices=["auto", "on", "off"],
        help="measure every machine's speed and link (a few seconds per new member) so that "
        "auto serves the fastest predicted plan and every plan shows its prediction; auto: "
        "when a member is another machine; on: also alone or over loopback",
    )


def kv_bits_from(value: str) -> int:
    """--kv-bits: 8 or 4, or 0 for off."""
    from errors import ConfigError
    from planner.memory import KV_BITS

    value = str(value).strip()
    if value in ("off", "0"):
        return 0
    if value not in {str(bits) for bits in KV_BITS}:
        raise ConfigError(f"--kv-bits must be 8, 4 or off, got {value!r}")
    return int(value)


DEFAULT_DRAFT_TOKENS = 8  # --num-draft-tokens: what a lone request drafts per step at most
MOST_DRAFT_TOKENS = 16  # beyond this a verifying pass costs like a prefill chunk


def draft_tokens_from(value: int) -> int:
    """--num-draft-tokens: 0 (off) to MOST_DRAFT_TOKENS."""
    from errors import ConfigError

    if not 0 <= value <= MOST_DRAFT_TOKENS:
        raise ConfigError(f"--num-draft-tokens must be 0 to {MOST_DRAFT_TOKENS}, got {value}")
    return value


def quantized_kv_start_from(value: str) -> int:
    """--quantized-kv-start: a token count, 0 or more."""
    from errors import ConfigError

    try:
        tokens = int(str(value).strip())
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise ConfigError(f"--quantized-kv-start must be 0 or more tokens, got {value!r}")
    return tokens


def prefix_cache_bytes_from(value: str) -> int | None:
    """--prefix-cache-bytes: bytes, 0 (off), or None for auto (the planner derives it)."""
    from discovery.capabilities import parse_memory_size
    from errors import ConfigError

    value = str(value).strip()
    if value in ("0", "off"):
        return 0
    if value == "auto":
        return None
    try:
        return parse_memory_size(value)
    except ConfigError as error:
        raise ConfigError(f"--prefix-cache-bytes: {error}, 0 or auto") from None
