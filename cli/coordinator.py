"""Wiring for `tandem serve` and live `tandem plan`: key, membership, supervisor, HTTP server."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from errors import PlanError
from planner import ClusterPlan, NodeResources, Parallelism

from .serve_config import ServeConfig

if TYPE_CHECKING:
    from .model_manager import ModelManager
    from .served_model import ServedModel

log = logging.getLogger(__name__)

KEY_FILE = "cluster.key"


def resolve_cluster_key(
    key_text: str | None, key_file: Path | None, state_dir: Path, create: bool
) -> tuple[bytes | None, bool]:
    """(key, created): the explicit key, the key file, or the one stored in the state dir."""
    from discovery.cluster_key import load_key_file, load_or_create_key, parse_key

    if key_text:
        return parse_key(key_text), False
    if key_file is not None:
        return load_key_file(key_file), False
    stored = state_dir / KEY_FILE
    if create:
        return load_or_create_key(stored)
    return (load_key_file(stored), False) if stored.exists() else (None, False)


def join_command(key: bytes, interface: str | None) -> str:
    from discovery.cluster_key import format_key

    flags = f" --interface {interface}" if interface else ""
    return f"tandem join --cluster-key {format_key(key)}{flags}"


def coordinator_resources(node_id: str, memory_limit: str | None) -> NodeResources:
    """This machine as a planner node: its available memory (capped) and collective backends."""
    from discovery.capabilities import MACHINE_BOUND, parse_memory_size, probe_capabilities

    limit = parse_memory_size(memory_limit) if memory_limit else None
    capabilities = probe_capabilities(memory_limit=limit)
    bound = capabilities.memory_bound
    return NodeResources(
        node_id=node_id,
        address="",
        memory_bytes=capabilities.memory_available,
        backends=capabilities.backends,
        memory_bound="" if bound == MACHINE_BOUND else bound,
    )


def coordinator_address(interface: str | None, members: list[Any]) -> str:
    """Where the other members reach this machine (ring rank 0, pipeline return hop)."""
    if interface and not ipaddress.ip_address(interface).is_unspecified:
        return interface
    if members:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((members[0].address, 9))  # UDP connect picks a route; sends nothing
            return str(probe.getsockname()[0])
    return "127.0.0.1"


def open_membership(
    key: bytes,
    interface: str | None,
    discovery_timeout_s: float,
    hostfile: Path | None,
    lost_after_s: float = 5.0,
    supervisor: Any = None,
):
    """Discover (zeroconf or hostfile) and verify the cluster's agents."""
    from discovery.membership import Membership

    membership = Membership(
        key,
        interface=interface,
        lost_after_s=lost_after_s,
        on_member_lost=supervisor.on_member_lost if supervisor else None,
        on_assignment_failed=supervisor.on_assignment_failed if supervisor else None,
    )
    addresses = None
    if hostfile is not None:
        from discovery.hostfile import load_hostfile

        entries = load_hostfile(hostfile).entries[1:]  # rank 0 is this coordinator
        addresses = [
            (entry.ips[0] if entry.ips else entry.ssh, entry.control_port) for entry in entries
        ]
    from .progress import waiting

    with waiting("looking for peers", None if addresses else discovery_timeout_s):
        members = membership.discover(discovery_timeout_s, addresses=addresses)
    for member in members:
        status = "verified" if member.verified else f"NOT verified ({member.reason})"
        log.info("peer %s at %s:%d: %s", member.node_id, member.address, member.port, status)
    return membership


def plan_live_cluster(args: argparse.Namespace, facts: Any) -> tuple[ClusterPlan, list[Any]]:
    """`tandem plan` without --world-size: discover, verify, and plan as `serve` would (same
    planning function and choices, weights sent to agents that lack them); nothing starts."""
    from engines.cluster.planning import plan_nodes
    from engines.cluster.speed_survey import SpeedSurvey, wants_measuring
    from engines.weights.source import WeightSource

    settings = plan_settings_of(args)
    key, _ = resolve_cluster_key(
        args.cluster_key, args.cluster_key_file, args.state_dir, create=False
    )
    nodes = [coordinator_resources(f"{socket.gethostname()}-coordinator", args.memory_limit)]
    members: list[Any] = []
    verified: list[Any] = []
    survey, speeds = None, None
    tp_possible = Parallelism(args.parallelism).may_plan_tp
    if key is not None:
        membership = open_membership(key, args.interface, args.discovery_timeout, args.hostfile)
        try:
            members = membership.members()
            # An agent busy with the running `serve` is still verified: plan as if it were free
            # (it cannot run a speed probe, so it is planned by the rules alone).
            verified = [m for m in members if m.verified and m.hello is not None]
            nodes += member_resources(verified)
            if wants_measuring(args.measure_speeds, nodes):
                here = coordinator_address(args.interface, members)
                survey = SpeedSurvey(membership, nodes[0].node_id, here)
                speeds = survey.for_plan(facts, nodes, settings.max_batch, tp_possible)
        finally:
            membership.close()
    if survey is None and wants_measuring(args.measure_speeds, nodes):  # alone, and asked
        survey = SpeedSurvey(None, nodes[0].node_id)
        speeds = survey.for_plan(facts, nodes, settings.max_batch, tp_possible)
    for line in survey.describe() if survey is not None else ():
        print(line)
    print_members(members)
    weights = None
    if key is not None and verified:  # never serves here: it only sizes (and maybe hashes)
        weights = WeightSource(facts.path, key, "127.0.0.1", args.cache_dir)
    return plan_nodes(facts, settings, nodes, verified, weights, speeds), members


def member_resources(verified: list[Any]) -> list[NodeResources]:
    """Verified members as planner nodes. An agent busy with the running `serve` counts: the
    plan is made as if it were free."""
    return [
        NodeResources(
            m.node_id,
            m.address,
            m.memory_available,
            tuple(m.hello.backends),
            disk_free_bytes=m.model_cache.free_bytes if m.model_cache else None,
        )
        for m in verified
    ]


def print_members(members: list[Any]) -> None:
    for member in members:
        status = "verified" if member.verified else f"unverified: {member.reason}"
        print(f"peer {member.node_id} {member.address}:{member.port} {status}")


def plan_settings_of(args: argparse.Namespace) -> Any:
    """The planning choices `tandem plan` reads as serve would act on them."""
    from engines.cluster.planning import PlanSettings

    from .options import (
        kv_bits_from,
        max_batch_from,
        prefix_cache_bytes_from,
        quantized_kv_start_from,
    )

    max_batch, shrink_batch = max_batch_from(args.max_batch)
    return PlanSettings(
        Parallelism(args.parallelism),
        args.collective,
        args.context_tokens,
        1,
        max_batch,
        cpu_float32=args.cpu_float32 == "auto",
        prefix_cache_bytes=prefix_cache_bytes_from(args.prefix_cache_bytes),
        measure=args.measure_speeds,
        kv_bits=kv_bits_from(args.kv_bits),
        quantized_kv_start=quantized_kv_start_from(args.quantized_kv_start),
        shrink_batch=shrink_batch,
    )


def open_request_log(config: ServeConfig, models: Any) -> Any:
    """The JSON-lines request log the flags ask for, listening to every model; None when off."""
    from engines.observability.request_log import RequestLog, RequestLogSettings

    observability = config.observability
    settings = RequestLogSettings(
        path=observability.request_log,
        stdout=observability.request_log_stdout,
        max_bytes=observability.request_log_max_bytes,
        backups=observability.request_log_backups,
        include_prompt=observability.request_log_prompts,
    )
    if not settings.enabled:
        return None
    request_log = RequestLog(settings, tokenizer=lambda model: models.get(model).tokenizer)
    models.listen(request_log.write)
    log.info("request log: %s", settings.path or "stdout")
    return request_log


def serve(config: ServeConfig) -> int:
    """Plan, launch, and serve until interrupted; exit status 2 when nothing fits."""
    from .public_address import bind_public_address

    listener = bind_public_address(config.host, config.port)  # first: fail fast, never shared
    try:
        return _serve(config, listener)
    finally:
        listener.close()


def _serve(config: ServeConfig, listener: socket.socket) -> int:
    from engines.core.core_process import PROCESS_CORE, discard_spare
    from engines.core.core_process import prewarm as prewarm_core

    if config.engine_core == PROCESS_CORE:
        prewarm_core()  # first: its imports overlap ours, fetching the model and planning
    from engines.api.app import create_app
    from engines.core import blas
    from engines.core.service_registry import ServiceRegistry

    from .http_server import run_http_server
    from .model_manager import ModelManager, ServingContext
    from .served_model import MemberEvents, ServedModel, check_ids, model_choices

    log.info("BLAS: %s", blas.status().describe())
    choices = model_choices(config)
    # Single with several models still places them: a model may run alone on an agent.
    wants_cluster = config.parallelism != Parallelism.SINGLE or bool(config.more_models)
    key = _cluster_key(config, wants_cluster)
    node_id = f"{socket.gethostname()}-coordinator"
    coordinator = coordinator_resources(node_id, config.memory_limit)
    limits = _service_limits(config)
    served = [ServedModel.open(config, choice, limits, coordinator) for choice in choices]
    check_ids(served, config)
    models = ServiceRegistry(model.service for model in served)
    membership = None
    if wants_cluster and key is not None:
        # every model's supervisor, those loaded later too (`manager` is bound below, before
        # anything can join or fail)
        events = MemberEvents(lambda: manager.supervisors())
        membership = _open_membership(config, key, events)
    address = coordinator_address(config.interface, membership.members() if membership else [])
    context = ServingContext(config, limits, coordinator, membership, key, address, node_id)
    manager = ModelManager(context, models, served)  # closes every model, those loaded later too
    request_log = open_request_log(config, models)
    try:
        _start_models(manager, served)
        stopping = threading.Event()
        app = create_app(
            models,
            max_prompt_tokens=config.context_tokens,
            max_body_bytes=config.max_body_bytes,
            metrics_open=config.observability.metrics_open,
            dashboard_open=config.observability.dashboard_open,
            stopping=stopping,
            model_loader=manager,
        )
        _log_addresses(config, served)
        run_http_server(app, listener, stopping, config.http)
    finally:
        discard_spare()
        manager.close()
        if membership is not None:
            membership.close()
        if request_log is not None:  # last: the requests failed by the shutdown are logged too
            request_log.close()
    return 0


def _cluster_key(config: ServeConfig, wants_cluster: bool) -> bytes | None:
    """The cluster key (created in the state dir when a cluster is wanted and none is given),
    and, for a cluster, the command that joins the other machines to it."""
    key, created = resolve_cluster_key(
        config.cluster_key, config.cluster_key_file, config.state_dir, create=wants_cluster
    )
    if wants_cluster and key is not None:
        if created:
            log.info("created a cluster key in %s", config.state_dir / KEY_FILE)
        log.info("on every other machine run:  %s", join_command(key, config.interface))
    return key


def _service_limits(config: ServeConfig) -> Any:
    """What the API holds every request of every model to (engines.core.service)."""
    from engines.core.service import ServiceLimits  # loaded already: engines.api imports it

    return ServiceLimits(
        max_tokens_cap=config.max_tokens_cap,
        default_max_tokens=min(256, config.max_tokens_cap),
        request_timeout_s=config.request_timeout_s,
        api_key=config.api_key,
        temperature=config.temperature,
    )


def _open_membership(config: ServeConfig, key: bytes, events: Any) -> Any:
    """The cluster's membership as the flags find it: zeroconf or --hostfile."""
    return open_membership(
        key,
        config.interface,
        config.discovery_timeout_s,
        config.hostfile,
        config.lost_after_s,
        events,
    )


def _start_models(manager: ModelManager, served: list[ServedModel]) -> None:
    """Attach every model and start it (placed together first when there are several), or,
    with --load-on-demand, list it as unloaded; from then on, machines that join are placed in.
    """
    from .progress import loading
    from .served_model import place

    context, models = manager.context, manager.models
    config, membership = context.config, context.membership
    for model in served:
        model.attach(config, membership, context.key, context.address, context.node_id)
    if config.load_on_demand or config.keep_alive_s:
        models.on_demand = manager  # a request naming an unloaded model loads it
    if config.keep_alive_s:
        models.keep_alive_s = config.keep_alive_s
        manager.keep_alive(config.keep_alive_s)
    if config.load_on_demand:
        for model in served:
            manager.start_known(model)
    elif len(served) > 1:
        place(served, context.coordinator, membership)
    manager.watch_membership()  # from here on, who joins is placed in
    for model in served if not config.load_on_demand else ():
        try:
            what = f"starting {model.service.model_id}" if len(served) > 1 else None
            with loading(what or "starting the engine"):
                model.supervisor.start()
        except PlanError as error:
            which = f" {model.service.model_id}" if len(served) > 1 else ""
            raise PlanError(f"refusing to serve{which}: {error}") from error


def _log_addresses(config: ServeConfig, served: list[ServedModel]) -> None:
    for model in served:
        log.info(
            "serving %s (%s) on http://%s:%d/v1",
            model.service.model_id,
            model.facts.display_name,
            config.host,
            config.port,
        )
    log.info("dashboard: http://%s:%d/  metrics: /metrics", config.host, config.port)
