"""`tandem plan` with several --model: place the set (planner/placement.py) over --world-size
machines like this one, or over the live cluster, each model planned as serve plans it."""

from __future__ import annotations

import argparse
import socket
from dataclasses import replace
from typing import Any

from planner import NodeResources, Parallelism, PlanError
from planner.cluster_plan import JACCL
from planner.placement import ModelToPlace, place_models


def print_placement(args: argparse.Namespace, models: list[Any]) -> int:
    """Print each model and where the set goes; exit status 2 when it cannot be placed."""
    from engines.cluster.planning import plan_nodes

    from .coordinator import plan_settings_of

    if args.no_tp_variant:
        models = [replace(facts, has_tp_variant=False) for facts in models]
    if args.world_size is not None:
        nodes, members, weights = hypothetical_nodes(args), [], {}
    else:
        nodes, members, key = discover_nodes(args)
        weights = model_weights(models, key, args) if members else {}
    by_id = {facts.display_name: facts for facts in models}
    settings = plan_settings_of(args)

    def plan(model: ModelToPlace, group: list[NodeResources], relayed: bool) -> Any:
        facts, choice = by_id[model.model_id], replace(settings, choice=model.choice)
        weights_of = weights.get(model.model_id)
        return plan_nodes(facts, choice, group, members, weights_of, relayed=relayed)

    choice = Parallelism(args.parallelism)
    placement = place_models([ModelToPlace(f.display_name, choice) for f in models], nodes, plan)
    for facts in models:
        print(f"model: {facts.display_name} ({facts.model_type}, {facts.num_layers} layers)")
    for line in placement.describe():
        print(line)
    return 2 if placement.refusal else 0


def hypothetical_nodes(args: argparse.Namespace) -> list[NodeResources]:
    """--world-size machines like this one: its memory (--memory-limit caps it), each with the
    collective the dry run assumes (--collective, else jaccl; none with --no-distributed-group)."""
    from .coordinator import coordinator_resources

    if args.world_size < 1:
        raise PlanError(f"--world-size {args.world_size} must be at least 1 (this machine)")
    here = coordinator_resources(f"{socket.gethostname()}-coordinator", args.memory_limit)
    backends = () if args.no_distributed_group else (args.collective or JACCL,)
    coordinator = replace(here, backends=backends)
    others = [
        replace(coordinator, node_id=f"machine-{index}") for index in range(1, args.world_size)
    ]
    return [coordinator, *others]


def discover_nodes(args: argparse.Namespace) -> tuple[list[NodeResources], list[Any], Any]:
    """(nodes, verified members, cluster key): this machine and the verified agents, found as
    plan_live_cluster finds them (speeds are not measured when placing several models)."""
    from .coordinator import (
        coordinator_resources,
        member_resources,
        open_membership,
        print_members,
        resolve_cluster_key,
    )

    key, _ = resolve_cluster_key(
        args.cluster_key, args.cluster_key_file, args.state_dir, create=False
    )
    nodes = [coordinator_resources(f"{socket.gethostname()}-coordinator", args.memory_limit)]
    if key is None:
        return nodes, [], None
    membership = open_membership(key, args.interface, args.discovery_timeout, args.hostfile)
    try:
        members = membership.members()
    finally:
        membership.close()
    print_members(members)
    verified = [m for m in members if m.verified and m.hello is not None]
    return nodes + member_resources(verified), verified, key


def model_weights(models: list[Any], key: bytes, args: argparse.Namespace) -> dict[str, Any]:
    """Each model's WeightSource, so that agents lacking it must have the disk to receive it."""
    from engines.weights.source import WeightSource

    return {
        facts.display_name: WeightSource(facts.path, key, "127.0.0.1", args.cache_dir)
        for facts in models
    }
