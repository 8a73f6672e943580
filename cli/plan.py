"""`tandem plan`: print the decision, every rule checked, and the assignment — no model loaded."""

from __future__ import annotations

import argparse
from pathlib import Path

from discovery.directories import default_cache_dir, default_state_dir
from planner import DecisionInputs, Parallelism, capability_checks, decide

from .model_source import MODEL_HELP
from .options import (
    add_flag,
    add_interface_flag,
    add_key_flags,
    add_max_batch_flag,
    add_planning_flags,
    env_default,
    kv_bits_from,
    quantized_kv_start_from,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="dry-run the planner: for given inputs (--world-size) or against the live cluster",
    )
    parser.add_argument(
        "--model",
        action="append",
        help=f"{MODEL_HELP}; repeat it to preview placing several models "
        "[env TANDEM_MODEL, one model]",
    )
    add_flag(
        parser,
        "--parallelism",
        default="auto",
        choices=[p.value for p in Parallelism],
        help="operator choice",
    )
    _add_what_if_flags(parser)
    _add_membership_flags(parser)
    add_flag(parser, "--context-tokens", default=4096, cast=int, help="KV cache budget per request")
    add_max_batch_flag(parser)
    add_planning_flags(parser)
    add_flag(parser, "--memory-limit", help="memory this machine offers the model (e.g. 8G)")
    _add_directory_flags(parser)
    parser.set_defaults(run=run)


def _add_what_if_flags(parser: argparse.ArgumentParser) -> None:
    """Inputs to plan for in place of the live cluster's: its size, what the model and mlx offer."""
    parser.add_argument(
        "--world-size",
        type=int,
        help="plan for N machines instead of the live cluster (with several --model: N "
        "machines like this one, --memory-limit capping each)",
    )
    parser.add_argument(
        "--no-tp-variant", action="store_true", help="pretend the model has no tp variant"
    )
    parser.add_argument(
        "--no-distributed-group",
        action="store_true",
        help="pretend no distributed group is available",
    )


def _add_membership_flags(parser: argparse.ArgumentParser) -> None:
    """How the live cluster is found and joined (as serve finds it)."""
    add_interface_flag(parser)
    add_key_flags(parser)
    add_flag(
        parser, "--discovery-timeout", default=3.0, cast=float, help="seconds to browse for peers"
    )
    add_flag(parser, "--hostfile", cast=Path, help="static membership instead of zeroconf")
    add_flag(
        parser,
        "--collective",
        choices=["ring", "jaccl"],
        help="accept this collective backend for tp",
    )


def _add_directory_flags(parser: argparse.ArgumentParser) -> None:
    """Where the models and this node's id and key are kept."""
    add_flag(
        parser,
        "--cache-dir",
        default=default_cache_dir(),
        cast=Path,
        help="models fetched, imported (GGUF, Ollama) or generated (demo)",
    )
    add_flag(
        parser,
        "--state-dir",
        default=default_state_dir(),
        cast=Path,
        help="node id and cluster key",
    )


def run(args: argparse.Namespace) -> int:
    from .model_source import resolve_model

    kv_bits_from(args.kv_bits)  # a bad value is refused before anything is looked up
    quantized_kv_start_from(args.quantized_kv_start)
    references = args.model or [env_default("MODEL")]
    if len(references) > 1:
        from .plan_placement import print_placement

        return print_placement(args, [resolve_model(ref, args.cache_dir) for ref in references])
    facts = resolve_model(references[0], args.cache_dir)
    if args.world_size is not None:
        return print_dry_run(args, facts)
    from .coordinator import plan_live_cluster

    plan, _members = plan_live_cluster(args, facts)
    print(f"model: {facts.display_name} ({facts.model_type}, {facts.num_layers} layers)")
    for line in plan.describe():
        print(line)
    return 2 if plan.refusal else 0


def print_dry_run(args: argparse.Namespace, facts) -> int:
    inputs = DecisionInputs(
        operator_choice=Parallelism(args.parallelism),
        world_size=args.world_size,
        attention_heads=facts.attention_heads,
        kv_heads=facts.kv_heads,
        has_tp_variant=facts.has_tp_variant and not args.no_tp_variant,
        distributed_group_available=not args.no_distributed_group,
        pipeline_problem=facts.pipeline_problem,
    )
    print(
        f"model: {facts.display_name} ({facts.model_type}, {facts.num_layers} layers, "
        f"{facts.attention_heads} attention heads, {facts.kv_heads} KV heads)"
    )
    for check in capability_checks(inputs):
        print(f"  [{'PASS' if check.passed else 'FAIL'}] {check.name}: {check.detail}")
    decision = decide(inputs)
    closed = f" (explicit {args.parallelism} failed closed)" if decision.failed_closed else ""
    print(f"decision: {decision.chosen.value}{closed}")
    print(f"reason: {decision.reason}")
    return 0
