"""One model of `tandem serve`: its Service, its supervisor and what they launch with, and how
several of them share the cluster (planner/placement.py places them; each then plans and
re-plans within its own group of machines)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from errors import ConfigError, PlanError
from planner import NodeResources

from .serve_config import ServeConfig

log = logging.getLogger(__name__)


DEMO_MODEL_ID = "tandem-demo"


def default_model_id(model: str | None, facts: Any) -> str:
    """The name clients use: the repo id, the Ollama name, the directory's name, or the default
    or demo model's name."""
    from engines.model.gguf.ollama_store import is_ollama_reference, parse_name
    from engines.model.pypi_models import BY_ID
    from engines.model.smollm2 import MODEL_ID

    from .model_source import DEMO_MODEL

    if model is None:
        return MODEL_ID
    if str(model) == DEMO_MODEL:
        return DEMO_MODEL_ID
    if str(model) in BY_ID:
        return str(model)
    if is_ollama_reference(model):
        return str(parse_name(str(model))).removesuffix(":latest")
    return facts.repo_id or facts.path.name


def rdma_rows(hostfile: Path | None) -> tuple[Any, ...]:
    """--hostfile's rdma rows for a JACCL plan (none without a hostfile or rdma rows)."""
    from discovery.hostfile import load_hostfile
    from engines.tensor_parallel.jaccl import RdmaRow

    if hostfile is None:
        return ()
    parsed = load_hostfile(hostfile)
    if not parsed.has_rdma:
        return ()
    return tuple(RdmaRow(tuple(e.ips), tuple(e.rdma or ())) for e in parsed.entries)


def own_active_rdma() -> tuple[str, ...]:
    """This machine's RDMA devices with an active port (JACCL's links when no hostfile)."""
    from discovery.capabilities import probe_rdma_devices

    return tuple(device.name for device in probe_rdma_devices() if device.active)


def draft_model_path(config: ServeConfig) -> Path | None:
    """--draft-model resolved as --model is (a directory, a GGUF imported once, a repo)."""
    if config.draft_model is None:
        return None
    from .model_source import resolve_model

    path = resolve_model(config.draft_model, config.cache_dir).path
    log.info("draft model: %s (drafts on the single engine; tp and pp use prompt lookup)", path)
    return Path(path)


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """A model the operator asked for: its reference (None: the default model) and the id
    clients name it by (None: derived from the reference once it is resolved)."""

    reference: str | None
    model_id: str | None
    first: bool = True  # the first --model: --model-id, --draft-model and bare aliases are its


def model_choices(config: ServeConfig) -> list[ModelChoice]:
    """Every --model in order; their ids are checked once resolved (check_ids)."""
    references = [config.model, *config.more_models]
    return [
        ModelChoice(reference, config.model_id if index == 0 else None, first=index == 0)
        for index, reference in enumerate(references)
    ]


@dataclass
class ServedModel:
    """A model's Service and ClusterSupervisor, and the weight server its agents fetch from."""

    facts: Any  # engines.model.info.ModelFacts
    service: Any  # engines.core.service.Service
    supervisor: Any  # engines.cluster.supervisor.ClusterSupervisor
    choice: ModelChoice
    weights: Any = None  # engines.weights.source.WeightSource, when agents may fetch

    @classmethod
    def open(
        cls, config: ServeConfig, choice: ModelChoice, limits: Any, coordinator: NodeResources
    ) -> ServedModel:
        from engines.cluster.planning import PlanSettings
        from engines.cluster.supervisor import ClusterSupervisor
        from engines.core.service import Service

        from .model_source import resolve_model

        facts = resolve_model(choice.reference, config.cache_dir)
        model_id = choice.model_id or default_model_id(choice.reference, facts)
        service = Service(
            model_id=model_id,
            model_aliases=_aliases_of(choice, model_id, config.model_aliases),
            model_revision=facts.revision,
            tokenizer=None,
            limits=limits,
        )
        several = bool(config.more_models)
        supervisor = ClusterSupervisor(
            service,
            facts,
            PlanSettings(
                config.parallelism,
                config.collective,
                config.context_tokens,
                config.queue_size,
                config.engine.max_batch,
                config.rediscover_interval_s,
                config.cpu_float32,
                config.prefix_cache_bytes,
                measure=config.measure_speeds,
                kv_bits=config.engine.kv_bits,
                quantized_kv_start=config.engine.quantized_kv_start,
                shrink_batch=config.shrink_batch,
            ),
            launch_settings=None,  # set by attach(), once the members (and our address) are known
            coordinator=lambda: coordinator,
            member_group=frozenset() if several else None,  # placed by place() before start
        )
        return cls(facts, service, supervisor, choice)

    def attach(
        self, config: ServeConfig, membership: Any, key: bytes | None, address: str, node_id: str
    ) -> None:
        """The membership, the weight server and the launch settings, once both are known."""
        from engines.cluster.launch import LaunchSettings
        from engines.cluster.pressure import watch_memory
        from engines.cluster.speed_survey import SpeedSurvey, wants_measuring

        supervisor, service = self.supervisor, self.service
        supervisor.membership = membership
        if membership is not None or wants_measuring(
            config.measure_speeds, [supervisor.coordinator()]
        ):
            # alone (no cluster key for single), "on" still measures this machine
            supervisor.survey = SpeedSurvey(membership, node_id, address)
        if membership is not None and key is not None and config.send_weights:
            from engines.weights.source import WeightSource

            self.weights = WeightSource(self.facts.path, key, address, config.cache_dir)
        supervisor.launch_settings = LaunchSettings(
            model_path=self.facts.path,
            model_reference=self.facts.reference,
            weights=self.weights,
            cluster_key=key,
            coordinator_address=address,
            options=self.engine_options(config),
            engine_core=config.engine_core,
            core_lost_after_s=config.lost_after_s,
            chat_template=config.chat_template if self.choice.first else None,
            rdma_rows=rdma_rows(config.hostfile),
            rdma_devices={node_id: own_active_rdma()},
        )
        weights = self.weights
        service.cluster_status = (
            supervisor.status
            if weights is None
            else lambda: {**supervisor.status(), "weights": weights.status()}
        )
        service.pressure = watch_memory(service, supervisor, node_id, config.memory_budget)

    def engine_options(self, config: ServeConfig) -> Any:
        """The flags' EngineOptions with this model's own prefix-cache directory and, for the
        first model, the draft model."""
        draft = draft_model_path(config) if self.choice.first else None
        directory = prefix_cache_dir(config.cache_dir, self.service.model_id, self.choice)
        return replace(
            config.engine,
            prefix_cache_dir=str(directory),
            draft_model_path=str(draft) if draft else None,
        )

    def close(self, state: str = "stopping", reason: str = "server is shutting down") -> None:
        """Stop serving it everywhere; its service is left in `state`."""
        if self.service.pressure is not None:
            self.service.pressure.close()
        self.supervisor.close(state, reason)
        if self.weights is not None:
            self.weights.close()


def _aliases_of(
    choice: ModelChoice, model_id: str, aliases: tuple[tuple[str, str | None], ...]
) -> tuple[tuple[str, str], ...]:
    """(pattern, model_id) for the --model-alias that name this model: NAME=ID by its id, a
    bare NAME the first model."""
    return tuple(
        (name, model_id)
        for name, target in aliases
        if target == model_id or (target is None and choice.first)
    )


def check_ids(models: list[ServedModel], config: ServeConfig) -> None:
    """Every model's id is its own, and every --model-alias NAME=ID names one of them."""
    ids = [model.service.model_id for model in models]
    repeated = sorted({model_id for model_id in ids if ids.count(model_id) > 1})
    if repeated:
        raise ConfigError(
            f"two --model share the id '{repeated[0]}'; serve each once, or give the first "
            "another name with --model-id"
        )
    for _, target in config.model_aliases:
        if target is not None and target not in ids:
            served = ", ".join(f"'{model_id}'" for model_id in ids)
            raise ConfigError(f"--model-alias names '{target}', but this server serves {served}")


def prefix_cache_dir(cache_dir: Path, model_id: str, choice: ModelChoice) -> Path:
    """The first model's disk tier where it always was; each other model's a folder of its
    own: entries are keyed by tokens, which mean different things to different models."""
    if choice.first:
        return cache_dir / "prefix-cache"
    return cache_dir / f"prefix-cache-{re.sub(r'[^A-Za-z0-9._-]+', '_', model_id)}"


class MemberEvents:
    """The membership's callbacks, to every model's supervisor: each acts only on a member
    that has a part in its own plan."""

    def __init__(self, supervisors: Callable[[], list[Any]]) -> None:
        self.supervisors = supervisors

    def on_member_lost(self, node_id: str, reason: str) -> None:
        for supervisor in self.supervisors():
            supervisor.on_member_lost(node_id, reason)

    def on_assignment_failed(self, node_id: str, assignment_id: str, reason: str) -> None:
        for supervisor in self.supervisors():
            group = supervisor.member_group
            if group is None or node_id in group:
                supervisor.on_assignment_failed(node_id, assignment_id, reason)


def placement_of(models: list[ServedModel], coordinator: NodeResources, membership: Any) -> Any:
    """Where the models would go over the coordinator and the verified members
    (planner/placement.py), each planned as its supervisor plans it."""
    from engines.cluster.planning import plan_nodes
    from planner.placement import ModelToPlace, place_models

    members = membership.members() if membership is not None else []
    nodes = [coordinator, *(membership.to_resources() if membership is not None else [])]
    by_id = {model.service.model_id: model for model in models}

    def plan(wanted: ModelToPlace, group: list[NodeResources], relayed: bool) -> Any:
        model = by_id[wanted.model_id]
        settings = model.supervisor.plan_settings
        return plan_nodes(model.facts, settings, group, members, model.weights, relayed=relayed)

    wanted = [ModelToPlace(i, model.supervisor.plan_settings.choice) for i, model in by_id.items()]
    return place_models(wanted, nodes, plan)


def place(models: list[ServedModel], coordinator: NodeResources, membership: Any) -> Any:
    """Place the models (placement_of): each supervisor gets its group of members and the
    coordinator's memory less what the others need there. Raises PlanError, with the
    numbers, when the set does not fit."""
    placement = placement_of(models, coordinator, membership)
    if placement.refusal is not None:
        raise PlanError(f"refusing to serve: {placement.refusal}")
    for line in placement.describe():
        log.info("placement: %s", line)
    shares = coordinator_shares(placement, coordinator)
    for model in models:
        assign(model, placement, shares[model.service.model_id])
    return placement


def assign(model: ServedModel, placement: Any, share: NodeResources) -> None:
    """Give `model`'s supervisor its part of `placement` for its next plan: its share of the
    coordinator, its members, and whether it runs alone on its one agent (planner/relay.py)."""
    from planner.relay import is_relayed

    model_id = model.service.model_id
    model.supervisor.coordinator = lambda: share
    model.supervisor.member_group = group_of(placement, model_id)
    model.supervisor.relayed = is_relayed(placement.plans[model_id])


def coordinator_shares(placement: Any, coordinator: NodeResources) -> dict[str, NodeResources]:
    """Model id -> the coordinator as that model plans over it: less what the others need."""
    from planner.placement import less_taken, need_on

    needs = {m: need_on(plan, coordinator.node_id) for m, plan in placement.plans.items()}
    total = sum(needs.values())
    return {m: less_taken(coordinator, total - need) for m, need in needs.items()}


def group_of(placement: Any, model_id: str) -> frozenset[str]:
    """The members (not the coordinator) a placement gives a model."""
    return frozenset(placement.groups[model_id][1:])
