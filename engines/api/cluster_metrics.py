"""The /metrics series read live at every scrape, for every served model under its `model`
label: batch and queue, engine, prefix cache, speculation, step timing, memory, members."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, cast

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from engines.core.service import Service
from engines.core.service_registry import ServiceRegistry
from engines.observability.process_memory import process_memory

MODEL_LABEL = "model"  # the first label of every series here, and of the request series
# engine.info().detail["prefix_cache"] keys: counters grow, gauges go up and down
PREFIX_CACHE_COUNTERS = ("hits", "misses", "evictions", "disk_hits", "spills", "disk_failures")
PREFIX_CACHE_GAUGES = ("bytes", "entries", "disk_bytes", "disk_entries")
SPECULATION_COUNTERS = (  # engine.info().detail["speculation"] keys
    ("drafted", "Tokens drafted (prompt lookup or --draft-model) for the model to check"),
    ("accepted", "Drafted tokens the model agreed with (each saved one decoding pass)"),
    ("steps", "Verifying passes (each checks one draft, or decodes plainly without one)"),
)
RUNNER_GAUGES = (  # (metric, help, EngineRunner attribute)
    ("tandem_queue_depth", "Requests waiting for a batch slot", "queued"),
    ("tandem_queue_capacity", "Waiting requests before 429 (--queue-size)", "queue_size"),
    ("tandem_active_sequences", "Sequences in the running batch", "active"),
    ("tandem_batch_capacity", "Largest running batch (the plan's batch capacity)", "max_batch"),
)

Family = TypeVar("Family", GaugeMetricFamily, CounterMetricFamily, HistogramMetricFamily)


class Families:
    """One scrape's metric families by name: each made once, however many models add to it
    (a family named twice would be exposed twice). Every one is labelled by model first."""

    def __init__(self) -> None:
        self._made: dict[str, Metric] = {}

    def gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
        return self._family(GaugeMetricFamily, name, documentation, labels)

    def counter(
        self, name: str, documentation: str, labels: Sequence[str] = ()
    ) -> CounterMetricFamily:
        return self._family(CounterMetricFamily, name, documentation, labels)

    def histogram(
        self, name: str, documentation: str, labels: Sequence[str] = ()
    ) -> HistogramMetricFamily:
        return self._family(HistogramMetricFamily, name, documentation, labels)

    def _family(
        self, kind: type[Family], name: str, documentation: str, labels: Sequence[str]
    ) -> Family:
        if name not in self._made:
            self._made[name] = kind(name, documentation, labels=[MODEL_LABEL, *labels])
        return cast(Family, self._made[name])

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._made.values())


class ClusterCollector:
    """Read at every scrape, for the models served at that moment: one loaded since the last
    scrape appears, one unloaded through the API is gone."""

    def __init__(self, models: ServiceRegistry) -> None:
        self.models = models

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: its series depend on the cluster of the moment

    def collect(self) -> Iterator[Metric]:
        families = Families()
        for service in self.models.all():
            add_service(families, service)
        yield from families


def add_service(families: Families, service: Service) -> None:
    """One model's series: its runner, engine, memory, members and re-plans."""
    model = service.model_id
    runner = service.runner
    for name, documentation, attribute in RUNNER_GAUGES:
        value = getattr(runner, attribute) if runner is not None else 0
        families.gauge(name, documentation).add_metric([model], value)
    generated = families.counter(
        "tandem_generated_tokens", "Tokens produced by the engine steps, live"
    )
    generated.add_metric([model], service.generated_tokens)
    serving = families.gauge("tandem_serving", "1 for the model's current state", ["state"])
    serving.add_metric([model, service.state], 1)
    if runner is not None:
        info = runner.engine.info()
        engine = families.gauge(
            "tandem_engine_info", "The running engine", ["strategy", "world_size"]
        )
        engine.add_metric([model, info.strategy, str(info.world_size)], 1)
        cache = info.detail.get("prefix_cache")
        if isinstance(cache, dict):
            add_prefix_cache(families, model, cache)
        speculation = info.detail.get("speculation")
        if isinstance(speculation, dict):
            add_speculation(families, model, speculation)
        timing = info.detail.get("step_timing")
        if isinstance(timing, dict):
            add_step_timing(families, model, timing)
    accounting = families.gauge(
        "tandem_process_memory_bytes",
        "Each serving process's memory by kind (process: serve, or api and engine_core "
        "when the engine core runs apart): rss; mlx_active (= weights + prefix_cache + "
        "other_mlx: KV and scratch); mlx_cache; unaccounted (rss - mlx, its growth is a leak)",
        ["process", "kind"],
    )
    processes = runner.memory_accounting() if runner else {"serve": process_memory(None)}
    for process, memory in processes.items():
        for kind, value in memory.items():
            accounting.add_metric([model, process, kind], value)
    status = _cluster_status(service)
    add_members(families, model, status.get("members") or [])
    replans = families.counter("tandem_replans", "Re-plans, by kind of reason", ["reason"])
    for reason, count in (status.get("replans_by_reason") or {}).items():
        replans.add_metric([model, reason], count)


def add_prefix_cache(families: Families, model: str, cache: dict[str, Any]) -> None:
    for key in PREFIX_CACHE_COUNTERS:
        if isinstance(cache.get(key), int | float):
            name = f"tandem_prefix_cache_{key}"
            families.counter(name, f"Prefix cache {key}").add_metric([model], cache[key])
    for key in PREFIX_CACHE_GAUGES:
        if isinstance(cache.get(key), int | float):
            name = f"tandem_prefix_cache_{key}"
            families.gauge(name, f"Prefix cache {key} now").add_metric([model], cache[key])


def add_speculation(families: Families, model: str, counts: dict[str, Any]) -> None:
    """Speculative decoding's drafts (engines/speculation/lane.py SpeculationCounts)."""
    for key, documentation in SPECULATION_COUNTERS:
        family = families.counter(f"tandem_speculation_{key}", documentation)
        family.add_metric([model], counts.get(key) or 0)


def add_step_timing(families: Families, model: str, timing: dict[str, Any]) -> None:
    """The engine's step histograms (engines/observability/step_timing.py StepTimes.snapshot)."""
    steps = families.counter("tandem_engine_steps", "Engine steps timed (tp steps, pp frames)")
    steps.add_metric([model], timing.get("steps") or 0)
    family = families.histogram(
        "tandem_engine_step_seconds",
        "Seconds of each engine step segment, one observation per step (tp) or frame (pp)",
        ["segment"],
    )
    for segment, values in (timing.get("segments") or {}).items():
        buckets = [(str(bound), count) for bound, count in values["buckets"]]
        family.add_metric([model, segment], buckets, values["sum"])


def add_members(families: Families, model: str, members: list[dict[str, Any]]) -> None:
    """The members of the model's cluster: heartbeat, memory and tier, worker."""
    labels = ["node"]
    age = families.gauge(
        "tandem_member_heartbeat_age_seconds", "Seconds since the member's last heartbeat", labels
    )
    memory = families.gauge(
        "tandem_member_memory_available_bytes", "Memory the member offers", labels
    )
    connected = families.gauge(
        "tandem_member_connected", "1 when the member is verified and heartbeating", labels
    )
    worker = families.gauge(
        "tandem_member_worker_up", "1 when the member's worker process is ready", labels
    )
    tier = families.gauge(
        "tandem_member_memory_tier", "1 for the member's memory tier", ["node", "tier"]
    )
    for member in members:
        if not isinstance(member, dict):  # a hand-written cluster status (tests) may list names
            continue
        node = [model, str(member.get("node_id"))]
        if member.get("last_heartbeat_age_s") is not None:
            age.add_metric(node, member["last_heartbeat_age_s"])
        memory.add_metric(node, member.get("memory_available") or 0)
        connected.add_metric(node, 1 if member.get("state") == "connected" else 0)
        worker.add_metric(node, 1 if member.get("worker_state") == "ready" else 0)
        if member.get("memory_tier"):
            tier.add_metric([*node, str(member["memory_tier"])], 1)


def _cluster_status(service: Service) -> dict[str, Any]:
    try:
        status = service.cluster_status()
    except Exception:  # a scrape must still answer with what it has
        return {}
    return status if isinstance(status, dict) else {}
