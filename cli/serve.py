"""`tandem serve`: find the cluster, plan, start the engine, and serve the OpenAI API."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from discovery.directories import default_cache_dir, default_state_dir
from errors import ConfigError
from planner import Parallelism

from .http_limits import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, HttpLimits
from .model_source import MODEL_HELP
from .observability import add_observability_flags, observability_from_args
from .options import (
    DEFAULT_DRAFT_TOKENS,
    add_blas_flags,
    add_flag,
    add_interface_flag,
    add_key_flags,
    add_max_batch_flag,
    add_memory_budget_flag,
    add_planning_flags,
    apply_blas_flags,
    draft_tokens_from,
    env_default,
    kv_bits_from,
    max_batch_from,
    prefix_cache_bytes_from,
    quantized_kv_start_from,
)
from .serve_config import ServeConfig

log = logging.getLogger(__name__)

DEFAULT_PORT = 8000


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="plan the cluster and serve the OpenAI API")
    # In the order --help lists them (docs/cli.md holds that output).
    _add_model_flags(parser)
    add_flag(parser, "--host", default="127.0.0.1", help="HTTP bind address")
    add_flag(parser, "--port", default=DEFAULT_PORT, cast=int, help="HTTP port")
    add_max_batch_flag(parser)
    add_planning_flags(parser)
    add_flag(
        parser,
        "--prefix-cache-disk-bytes",
        default="0",
        help="disk under --cache-dir for prefix-cache entries evicted from memory, read back "
        "on a hit (e.g. 8G; 0 turns the disk tier off)",
    )
    _add_request_flags(parser)
    _add_membership_flags(parser)
    _add_memory_flags(parser)
    _add_engine_flags(parser)
    _add_liveness_flags(parser)
    add_blas_flags(parser)
    _add_storage_flags(parser)
    add_observability_flags(parser)
    parser.set_defaults(run=run)


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    """What is served, under which names, split how, and when it loads."""
    parser.add_argument(
        "--model",
        action="append",
        metavar="MODEL",
        help=f"{MODEL_HELP}; repeat it to serve several models at once, placed over the "
        "cluster together (the first is the default) [env TANDEM_MODEL: one model]",
    )
    add_flag(
        parser,
        "--model-id",
        help="model name clients use (default: the repo id, the Ollama NAME[:TAG], the "
        "directory name, smollm2-135m-instruct or tandem-demo)",
    )
    parser.add_argument(
        "--model-alias",
        action="append",
        default=model_aliases_from_env(),
        metavar="NAME[=ID]",
        help="another name that reaches the served model ID (the served model when ID is "
        "omitted); NAME may be a pattern such as 'claude-*' (a client's own model names); "
        "repeatable [env TANDEM_MODEL_ALIAS, comma-separated]",
    )
    add_flag(
        parser,
        "--chat-template",
        cast=Path,
        metavar="FILE",
        help="a Jinja chat template (vLLM's flag) to render the first --model's chats with, in "
        "place of its own; a model with none (a base model) answers chat routes with 400 and "
        "serves /v1/completions",
    )
    add_flag(
        parser,
        "--parallelism",
        default="auto",
        choices=[p.value for p in Parallelism],
        help="tp, pp, single, or auto (let the planner choose)",
    )
    parser.add_argument(
        "--load-on-demand",
        action="store_true",
        default=env_default("LOAD_ON_DEMAND", "") in ("1", "true", "yes"),
        help="load no model at start: a request naming one loads it and waits (up to "
        "--request-timeout); /v1/models lists it unloaded until then [env "
        "TANDEM_LOAD_ON_DEMAND=1]",
    )
    add_flag(
        parser,
        "--keep-alive",
        default=0.0,
        cast=float,
        metavar="SECONDS",
        help="unload a model no request has used for this long (it loads again when one "
        "names it); 0 keeps every model loaded",
    )


def _add_request_flags(parser: argparse.ArgumentParser) -> None:
    """What the API takes: requests queued, their limits, HTTP connections, the key."""
    add_flag(
        parser,
        "--queue-size",
        default=8,
        cast=int,
        help="requests waiting for a batch slot before 429",
    )
    add_flag(parser, "--max-tokens-cap", default=4096, cast=int, help="largest max_tokens accepted")
    add_flag(parser, "--request-timeout", default=300.0, cast=float, help="seconds per request")
    add_flag(
        parser,
        "--temperature",
        default=None,
        cast=float,
        help="sampling temperature for a request that sets none (llama.cpp's --temp); "
        "default: each API's own (1.0, Ollama's 0.8). Agents such as Claude Code and Codex "
        "send none: 0 makes a small model's tool calls steadier",
    )
    add_flag(
        parser,
        "--max-body-bytes",
        default=4 * 1024 * 1024,
        cast=int,
        help="largest HTTP request body accepted; larger ones get 413 before they are read",
    )
    add_flag(
        parser,
        "--http-header-timeout",
        default=DEFAULT_HEADER_TIMEOUT_S,
        cast=float,
        help="seconds a client may take to send a request's headers; an idle or trickling "
        "connection (slowloris) is closed after it",
    )
    add_flag(
        parser,
        "--max-connections",
        default=DEFAULT_MAX_CONNECTIONS,
        cast=int,
        help="HTTP connections served at once; past it new requests get 503 at once",
    )
    add_flag(
        parser,
        "--api-key",
        help="require the key on /v1 and /api (`Authorization: Bearer KEY` or `x-api-key: KEY`)",
    )


def _add_membership_flags(parser: argparse.ArgumentParser) -> None:
    """How this machine finds its peers and proves the cluster key to them."""
    add_interface_flag(parser)
    add_flag(
        parser, "--discovery-timeout", default=3.0, cast=float, help="seconds to browse for peers"
    )
    add_flag(
        parser,
        "--hostfile",
        cast=Path,
        help="static membership (mlx.launch JSON) instead of zeroconf",
    )
    add_key_flags(parser)
    add_flag(
        parser,
        "--collective",
        choices=["ring", "jaccl"],
        help="accept this collective backend for tp (ring: TCP, for Linux and tests)",
    )


def _add_memory_flags(parser: argparse.ArgumentParser) -> None:
    """The memory a request's KV and the model may take here."""
    add_flag(parser, "--context-tokens", default=4096, cast=int, help="KV cache budget per request")
    add_flag(parser, "--memory-limit", help="memory this machine offers the model (e.g. 8G)")
    add_memory_budget_flag(parser)


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Where this machine's part of the model runs, and how it drafts tokens."""
    add_flag(
        parser,
        "--engine-core",
        default="process",
        choices=["process", "thread"],
        help="where this machine's part of the model runs: process, an engine-core process "
        "beside the API's (the model's steps never wait for HTTP, tokenizing or streaming); "
        "thread, a thread of serve itself (one interpreter, as before the split)",
    )
    add_flag(
        parser,
        "--num-draft-tokens",
        default=DEFAULT_DRAFT_TOKENS,
        cast=int,
        metavar="N",
        help="speculative decoding by prompt lookup: a request decoding alone drafts up to N "
        "tokens from its own prompt and output and the model checks them in one pass "
        "(greedy and seeded tokens unchanged; it backs off when drafts miss); 0 turns it off",
    )
    add_flag(
        parser,
        "--draft-model",
        default=None,
        metavar="MODEL",
        help="draft with this smaller model (named as --model names one; it must share the "
        "served model's tokenizer) instead of by prompt lookup; on one machine only",
    )


def _add_liveness_flags(parser: argparse.ArgumentParser) -> None:
    """How soon a silent peer is lost, and how often late joiners are looked for."""
    add_flag(
        parser,
        "--lost-after",
        default=5.0,
        cast=float,
        help="seconds of silence before a peer, or the engine core, is lost",
    )
    add_flag(
        parser,
        "--rediscover-interval",
        default=10.0,
        cast=float,
        help="seconds between looks for agents that joined later (while idle; 0 = never)",
    )


def _add_storage_flags(parser: argparse.ArgumentParser) -> None:
    """What this machine keeps on disk, and whether it sends the model to agents."""
    add_flag(
        parser,
        "--cache-dir",
        default=default_cache_dir(),
        cast=Path,
        help="models fetched, imported (GGUF, Ollama) or generated (demo), and manifests of "
        "models sent to agents",
    )
    add_flag(
        parser,
        "--send-weights",
        default="auto",
        choices=["auto", "off"],
        help="auto: an agent that cannot find the model fetches it from this machine over the "
        "cluster's encrypted channel (its pp share, or all of it for tp), and the plan checks "
        "its free cache disk first; off: every machine needs its own copy",
    )
    add_flag(
        parser,
        "--state-dir",
        default=default_state_dir(),
        cast=Path,
        help="node id and cluster key",
    )


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    from discovery.capabilities import parse_memory_size

    engine = engine_options_from(args)
    if args.queue_size < 1:
        raise ConfigError(f"--queue-size must be at least 1, got {args.queue_size}")
    check_http_limits(args)
    models = args.model or [env_default("MODEL")]
    if args.keep_alive < 0:
        raise ConfigError(f"--keep-alive must be 0 or more seconds, got {args.keep_alive}")
    return ServeConfig(
        model=models[0],
        more_models=tuple(models[1:]),
        load_on_demand=bool(args.load_on_demand),
        keep_alive_s=args.keep_alive,
        model_id=args.model_id,
        model_aliases=parse_model_aliases(args.model_alias or []),
        parallelism=Parallelism(args.parallelism),
        host=args.host,
        port=args.port,
        queue_size=args.queue_size,
        engine=engine,
        shrink_batch=max_batch_from(args.max_batch)[1],
        prefix_cache_bytes=prefix_cache_bytes_from(args.prefix_cache_bytes),
        draft_model=args.draft_model,
        engine_core=args.engine_core,
        cpu_float32=args.cpu_float32 == "auto",
        measure_speeds=args.measure_speeds,
        max_tokens_cap=args.max_tokens_cap,
        request_timeout_s=args.request_timeout,
        temperature=args.temperature,
        api_key=args.api_key,
        interface=args.interface,
        discovery_timeout_s=args.discovery_timeout,
        hostfile=args.hostfile,
        cluster_key=args.cluster_key,
        cluster_key_file=args.cluster_key_file,
        collective=args.collective,
        context_tokens=args.context_tokens,
        memory_limit=args.memory_limit,
        memory_budget=parse_memory_size(args.memory_budget) if args.memory_budget else None,
        lost_after_s=args.lost_after,
        rediscover_interval_s=args.rediscover_interval,
        cache_dir=args.cache_dir,
        state_dir=args.state_dir,
        observability=observability_from_args(args),
        send_weights=args.send_weights == "auto",
        max_body_bytes=args.max_body_bytes,
        http=HttpLimits(args.http_header_timeout, args.max_connections),
        chat_template=read_chat_template(args.chat_template),
    )


def engine_options_from(args: argparse.Namespace) -> Any:
    """The EngineOptions the flags ask every engine for, each checked under its flag's name
    (the plan adds the batch that fits, the prefix cache's budget and the precision)."""
    from engines.core.engine_options import EngineOptions

    return EngineOptions(
        max_batch=max_batch_from(args.max_batch)[0],
        prefix_cache_disk_bytes=disk_bytes_from(args.prefix_cache_disk_bytes),
        kv_bits=kv_bits_from(args.kv_bits),
        quantized_kv_start=quantized_kv_start_from(args.quantized_kv_start),
        most_drafted=draft_tokens_from(args.num_draft_tokens),
        blas_threads=max(0, args.blas_threads),  # 0 or less: every core, as ever
    )


def check_http_limits(args: argparse.Namespace) -> None:
    """ConfigError for the first of max_tokens, the temperature, the body, the headers' time,
    the connections and the port that is out of range."""
    from engines.core.request import MAX_TEMPERATURE, MAX_TOKENS

    if not 1 <= args.max_tokens_cap <= MAX_TOKENS:
        raise ConfigError(
            f"--max-tokens-cap must be between 1 and {MAX_TOKENS}, got {args.max_tokens_cap}"
        )
    if args.temperature is not None and not 0 <= args.temperature <= MAX_TEMPERATURE:
        raise ConfigError(
            f"--temperature must be between 0 and {MAX_TEMPERATURE}, got {args.temperature}"
        )
    if args.max_body_bytes < 1:
        raise ConfigError(f"--max-body-bytes must be at least 1, got {args.max_body_bytes}")
    if args.http_header_timeout <= 0:
        raise ConfigError(f"--http-header-timeout must be positive, got {args.http_header_timeout}")
    if args.max_connections < 1:
        raise ConfigError(f"--max-connections must be at least 1, got {args.max_connections}")
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be 1..65535, got {args.port}")


def disk_bytes_from(value: str) -> int:
    """--prefix-cache-disk-bytes in bytes: a size such as 8G, or 0 / off."""
    from discovery.capabilities import parse_memory_size

    try:
        disk = str(value).strip()
        return 0 if disk in ("0", "off") else parse_memory_size(disk)
    except ConfigError as error:
        raise ConfigError(f"--prefix-cache-disk-bytes: {error}, or 0") from None


def read_chat_template(path: Path | None) -> str | None:
    """--chat-template's text, read before anything loads."""
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise ConfigError(f"--chat-template {path}: cannot read it ({reason})") from None
    if not text.strip():
        raise ConfigError(f"--chat-template {path} is empty: give a Jinja chat template")
    return text


def model_aliases_from_env() -> list[str] | None:
    raw = env_default("MODEL_ALIAS")
    return [item.strip() for item in raw.split(",") if item.strip()] if raw else None


def parse_model_aliases(values: list[str]) -> tuple[tuple[str, str | None], ...]:
    """(pattern, served id or None for the served model) for each --model-alias."""
    aliases = []
    for value in values:
        name, _, target = value.partition("=")
        if not name.strip() or (value.count("=") and not target.strip()):
            raise ConfigError(f"--model-alias must be NAME or NAME=ID, got {value!r}")
        aliases.append((name.strip(), target.strip() or None))
    return tuple(aliases)


def run(args: argparse.Namespace) -> int:
    apply_blas_flags(args)  # before anything under engines/ is imported, here or in workers
    config = config_from_args(args)
    from .coordinator import serve

    return serve(config)
