"""The dashboard's HTML fragments, rendered from /v1/cluster, the served models, live samples
and recent requests."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

from engines.observability.request_timing import SEGMENTS, RequestRecord
from engines.observability.served_speed import on_node

CHART_WIDTH = 240
CHART_HEIGHT = 48


@dataclass(frozen=True, slots=True)
class Sample:
    """One look at the runner, taken at most once a second while someone watches."""

    at: float  # monotonic seconds
    generated_tokens: int
    queued: int
    active: int
    capacity: int


@dataclass(frozen=True, slots=True)
class ModelRow:
    """One served model as the Models section lists it."""

    model_id: str
    state: str  # its health: ok, starting, degraded, unloaded, failed ...
    reason: str
    strategy: str | None  # None until it has a plan
    nodes: tuple[str, ...]  # the nodes its plan runs on, in rank order
    active: int
    capacity: int
    queued: int
    generated_tokens: int


def render_models(rows: Sequence[ModelRow]) -> str:
    """Every served model: state and why, its plan's strategy and nodes, its load."""
    if not rows:
        return '<p class="muted">no model is served</p>'
    cells = []
    for row in rows:
        reason = f' <span class="muted">{escape(row.reason)}</span>' if row.reason else ""
        cells.append(
            f'<tr data-model="{escape(row.model_id)}"><td>{escape(row.model_id)}</td>'
            f'<td><span class="badge {_state_class(row.state)}">{escape(row.state)}</span>'
            f"{reason}</td><td>{escape(row.strategy or '—')}</td>"
            f"<td>{escape(', '.join(row.nodes) or '—')}</td>"
            f'<td class="num">{row.active}/{row.capacity}</td>'
            f'<td class="num">{row.queued}</td><td class="num">{row.generated_tokens}</td></tr>'
        )
    head = (
        "<tr><th>model</th><th>state</th><th>strategy</th><th>nodes</th><th>active</th>"
        "<th>queued</th><th>tokens</th></tr>"
    )
    return f'<div class="scroll"><table class="models">{head}{"".join(cells)}</table></div>'


def render_summary(status: dict[str, Any], health: dict[str, Any], model: str) -> str:
    state = str(health.get("status", "unknown"))
    reason = status.get("reason") or health.get("reason") or ""
    items = [
        ("state", f'<span class="badge {_state_class(state)}">{escape(state)}</span>'),
        ("strategy", f'<b id="strategy">{escape(str(status.get("strategy") or "—"))}</b>'),
        ("model", escape(model)),
        ("nodes", escape(str(status.get("world_size", 1)))),
        ("re-plans", escape(str(status.get("replans", 0)))),
    ]
    if cache := (status.get("engine") or {}).get("prefix_cache"):
        items.append(("prefix cache", escape(_prefix_cache(cache))))
    cells = "".join(f'<div class="stat"><span>{k}</span>{v}</div>' for k, v in items)
    return f'<div class="stats">{cells}</div><p class="reason">{escape(str(reason))}</p>'


def render_rules(status: dict[str, Any]) -> str:
    plan = status.get("plan") or {}
    checks = plan.get("checks") or []
    if not checks:
        return '<p class="muted">no plan yet</p>'
    rows = "".join(
        f'<tr><td><span class="badge {"ok" if check.get("passed") else "bad"}">'
        f"{'PASS' if check.get('passed') else 'FAIL'}</span></td>"
        f"<td>{escape(str(check.get('name', '')))}</td>"
        f'<td class="muted">{escape(str(check.get("detail", "")))}</td></tr>'
        for check in checks
    )
    refusal = plan.get("refusal")
    note = f'<p class="bad-text">{escape(str(refusal))}</p>' if refusal else ""
    return f'<table class="rules">{rows}</table>{note}'


def render_members(status: dict[str, Any]) -> str:
    """The coordinator and every agent: role, memory bar (with tier), heartbeat, backends."""
    plan = status.get("plan") or {}
    needs = {fit.get("node_id"): fit.get("need_bytes") for fit in plan.get("fits") or []}
    roles = _roles(plan, status.get("strategy"))
    coordinator = dict(status.get("coordinator") or {})
    coordinator.setdefault("state", "coordinator")
    members = [m for m in status.get("members") or [] if isinstance(m, dict)]
    nodes = [coordinator, *members] if coordinator.get("node_id") else members
    if not nodes:
        return '<p class="muted">no members</p>'
    cards = []
    for node in nodes:
        node_id = str(node.get("node_id", "?"))
        available = int(node.get("memory_available") or 0)
        need = needs.get(node_id)
        tier = node.get("memory_tier")
        age = node.get("last_heartbeat_age_s")
        facts = [
            ("role", roles.get(node_id, "idle")),
            ("state", node.get("state") or "—"),
            ("heartbeat", "—" if age is None else f"{age:.1f} s ago"),
            ("backends", ", ".join(node.get("backends") or []) or "—"),
            ("worker", node.get("worker_state") or "—"),
        ]
        if accounting := node.get("memory_accounting"):
            facts.append(("process memory", _accounting(accounting)))
        rows = "".join(f"<dt>{k}</dt><dd>{escape(str(v))}</dd>" for k, v in facts)
        cards.append(
            f'<div class="member" data-node="{escape(node_id)}">'
            f"<h3>{escape(node_id)}</h3><dl>{rows}</dl>"
            f"{_memory_bar(need, available, tier)}{_transfer_bar(node.get('transfer'))}</div>"
        )
    return f'<div class="members">{"".join(cards)}</div>'


def _prefix_cache(cache: dict[str, Any]) -> str:
    """Hits over lookups, and the bytes held in memory and (with a disk tier) on disk."""
    lookups = int(cache.get("hits", 0)) + int(cache.get("misses", 0))
    text = f"{cache.get('hits', 0)}/{lookups} hits, {int(cache.get('bytes', 0)) >> 20} MB"
    if cache.get("disk_max_bytes"):
        text += f" + {int(cache.get('disk_bytes', 0)) >> 20} MB on disk"
    return text


def _accounting(processes: dict[str, dict[str, Any]]) -> str:
    """Per serving process (serve; or api and engine_core), RSS and what it is made of, in
    MB: the weights, the prefix cache, the rest of mlx's arrays (KV, scratch), mlx's cache,
    and what nothing accounts for."""
    lines = []
    for process, memory in processes.items():
        mb = {kind: int(value) >> 20 for kind, value in memory.items()}
        lines.append(
            f"{process}: RSS {mb.get('rss', 0)} MB = weights {mb.get('weights', 0)} + prefix "
            f"cache {mb.get('prefix_cache', 0)} + KV/scratch {mb.get('other_mlx', 0)} + mlx "
            f"cache {mb.get('mlx_cache', 0)} + unaccounted {mb.get('unaccounted', 0)}"
        )
    return "; ".join(lines)


def render_charts(samples: Sequence[Sample]) -> str:
    rates = _token_rates(samples)
    queued = [float(s.queued) for s in samples]
    active = [float(s.active) for s in samples]
    capacity = samples[-1].capacity if samples else 0
    charts = [
        ("tokens/s", rates, f"{rates[-1]:.1f}" if rates else "0"),
        ("queue", queued, f"{int(queued[-1])}" if queued else "0"),
        ("active", active, f"{int(active[-1])} / {capacity}" if active else "0"),
    ]
    return (
        '<div class="charts">'
        + "".join(
            f'<div class="chart"><span>{name}</span><b data-chart="{name}">{escape(now)}</b>'
            f"{_sparkline(values)}</div>"
            for name, values, now in charts
        )
        + "</div>"
    )


def render_requests(records: Sequence[RequestRecord], by_model: bool = False) -> str:
    """The last requests, newest first; `by_model` (several models served) names each one's."""
    if not records:
        return '<p class="muted">no requests yet</p>'
    legend = "".join(f'<span class="seg-{name}">{name}</span>' for name in SEGMENTS)
    rows = []
    for record in reversed(records):
        total = record.duration_s or 1e-9
        bar = "".join(
            f'<i class="seg-{name}" style="width:{100 * value / total:.1f}%" '
            f'title="{name} {value * 1000:.1f} ms"></i>'
            for name, value in record.segments().items()
        )
        tokens = f"{record.prompt_tokens}→{record.completion_tokens}"
        if record.cached_tokens:
            tokens += f" ({record.cached_tokens} cached)"
        if record.drafted_tokens:  # speculative decoding: how many drafts the model kept
            tokens += f" ({record.accepted_tokens}/{record.drafted_tokens} drafts accepted)"
        status = record.finish_reason + (f": {record.error}" if record.error else "")
        model = f"<td>{escape(record.model)}</td>" if by_model else ""
        rows.append(
            f"<tr><td>{time.strftime('%H:%M:%S', time.localtime(record.started_at))}</td>"
            f'{model}<td title="{escape(record.request_id)}">{escape(record.request_id[-8:])}</td>'
            f"<td>{escape(status)}</td><td>{escape(tokens)}</td>"
            f"<td>{record.duration_s * 1000:.0f} ms</td>"
            f'<td class="breakdown"><div class="bar">{bar}</div>{_engine_line(record)}</td></tr>'
        )
    head = "<tr><th>time</th>" + ("<th>model</th>" if by_model else "")
    head += "<th>id</th><th>finish</th><th>tokens</th><th>total</th>"
    head += "<th>breakdown</th></tr>"
    return (
        f'<div class="legend">{legend}</div><div class="scroll"><table class="requests">'
        f"{head}{''.join(rows)}</table></div>"
    )


def _engine_line(record: RequestRecord) -> str:
    """The request's share of the engine's step segments (tp all_sum, pp stages and sealing),
    under its bar; shared by the batch, so not part of the bar."""
    if not record.engine_s:
        return ""
    parts = " · ".join(f"{name} {value * 1000:.1f}" for name, value in record.engine_s)
    return (
        f'<div class="muted" title="engine step segments (ms), shared by the batch">'
        f"{escape(parts)} ms</div>"
    )


def render_predictions(status: dict[str, Any]) -> str:
    """Every candidate the measured planner predicted (the serving one first) and, beside the
    serving one, what it really does; then what the probes measured."""
    predictions = (status.get("plan") or {}).get("predictions") or []
    if not predictions:
        return '<p class="muted">not measured: auto planned by the rules alone</p>'
    served = status.get("served") or {}
    speculating = (status.get("predicted") or {}).get("speculating")
    rows = "".join(
        f"<tr><td>{escape(str(p.get('label', '')))}{' (serving)' if index == 0 else ''}</td>"
        f"<td>{escape(', '.join(map(str, p.get('nodes') or [])))}</td>"
        f'<td class="num">{p.get("decode_tps", 0):.1f}'
        f"{_speculating(speculating) if index == 0 else ''}</td>"
        f'<td class="num">{p.get("batch_tps", 0):.1f} at {p.get("batch", "")}</td>'
        f'<td class="num">{p.get("ttft_ms", 0):.0f}</td>'
        f'<td class="num">{_served(served) if index == 0 else ""}</td>'
        f'<td class="muted">{escape(str(p.get("dominant", "")))}</td></tr>'
        for index, p in enumerate(predictions)
    )
    head = (
        "<tr><th>plan</th><th>nodes</th><th>predicted tok/s, 1 stream</th><th>full batch</th>"
        "<th>TTFT ms</th><th>served tok/s a stream</th><th>where the time goes</th></tr>"
    )
    speeds = status.get("speeds") or {}
    probes = "".join(
        f"<li>{escape(node)}: a layer {escape(str(speed.get('layer_ms')))} ms by rows</li>"
        for node, speed in (speeds.get("nodes") or {}).items()
    ) + "".join(
        f"<li>link to {escape(node)}: {link.get('latency_us')} us one way, "
        f"{link.get('mbit_per_s')} Mbit/s{_all_sum(link)}</li>"
        for node, link in (speeds.get("links") or {}).items()
    )
    if probes and speeds.get("measured_in_s") is not None:
        probes += f"<li>measuring took {speeds['measured_in_s']} s</li>"
    probed = f'<ul class="muted">{probes}</ul>' if probes else ""
    split = _segments_beside(predictions[0], served.get("segments_ms") or {})
    return f'<div class="scroll"><table>{head}{rows}</table></div>{split}{probed}'


def _segments_beside(prediction: dict[str, Any], served: dict[str, float]) -> str:
    """The serving plan's 1-stream token by engine segment, predicted -> served (pp: each
    stage on its node, and the hops), which says where a prediction is off."""
    predicted = prediction.get("segments_ms") or {}
    if not predicted:
        return ""
    nodes = prediction.get("nodes") or []
    parts = "; ".join(
        f"{on_node(name, nodes)} {ms:.1f} -> "
        + (f"{served[name]:.1f}" if name in served else "not served yet")
        for name, ms in predicted.items()
    )
    return f'<p class="muted">a 1-stream token, predicted -> served (ms): {escape(parts)}</p>'


def _all_sum(link: dict[str, Any]) -> str:
    """The link's measured 2-rank all_sum and tp layer, when there are (speed_survey.py)."""
    by_rows = link.get("all_sum_ms")
    text = f"; all_sum 2 ranks {escape(str(by_rows))} ms by rows" if by_rows else ""
    layer, rest = link.get("tp_layer_ms"), link.get("tp_rest_ms")
    if layer and rest:  # the 2-rank group's decode step, measured whole
        text += (
            f"; a tp layer of 2 ranks, all_sums included, {escape(str(layer))} ms by rows "
            f"(the rest {escape(str(rest))})"
        )
    return text


def _speculating(speculating: dict[str, Any] | None) -> str:
    """The serving plan's 1-stream prediction at the speculation its engine measured."""
    if not speculating:
        return ""
    return (
        f"; {speculating['decode_tps']:.1f} speculating "
        f"({speculating['tokens_per_pass']:.2f} tokens a pass)"
    )


def _served(served: dict[str, Any]) -> str:
    rate = served.get("decode_tps_per_stream")
    return f"{rate:.1f} ({served.get('requests', 0)} requests)" if rate else "no requests yet"


def render_replans(status: dict[str, Any]) -> str:
    history = status.get("replan_history") or []
    if not history:
        return '<p class="muted">no re-plans</p>'
    rows = "".join(
        f"<tr><td>{time.strftime('%H:%M:%S', time.localtime(entry.get('at', 0)))}</td>"
        f"<td>{escape(str(entry.get('kind', '')))}</td>"
        f"<td>{escape(str(entry.get('strategy') or 'pending'))}</td>"
        f'<td class="muted">{escape(str(entry.get("reason", "")))}</td></tr>'
        for entry in history
    )
    return f'<div class="scroll"><table>{rows}</table></div>'


def _roles(plan: dict[str, Any], strategy: Any) -> dict[str, str]:
    """node id → what it runs in the plan: tp rank, pp stage with its layers, or single."""
    roles: dict[str, str] = {}
    if strategy == "tp":
        for rank, node_id in enumerate(plan.get("ranks") or []):
            roles[node_id] = f"tp rank {rank}"
    elif strategy == "single" and plan.get("stages"):  # alone on an agent, relayed here
        relay, alone = plan["stages"]
        roles[relay.get("node_id")] = "single: relays (embedding)"
        roles[alone.get("node_id")] = "single: every layer"
    elif strategy == "pp":
        for index, stage in enumerate(plan.get("stages") or []):
            start, stop = stage.get("layers", [0, 0])
            roles[stage.get("node_id")] = f"pp stage {index}: layers {start}–{stop - 1}"
    else:
        for fit in plan.get("fits") or []:
            roles.setdefault(fit.get("node_id"), f"{strategy or 'single'}: every layer")
    return roles


def _memory_bar(need: int | None, available: int, tier: Any) -> str:
    share = min(need / available, 1.0) if need and available else 0.0
    label = f"{_gib(need)} of {_gib(available)}" if need else f"{_gib(available)} free"
    tier_text = f' <span class="tier">{escape(str(tier))}</span>' if tier else ""
    level = "bad" if share > 0.9 else "warn" if share > 0.7 else "ok"
    return (
        f'<div class="memory"><div class="label">memory{tier_text}<span>{label}</span></div>'
        f'<div class="track"><div class="fill {level}" style="width:{100 * share:.1f}%"></div>'
        "</div></div>"
    )


def _transfer_bar(transfer: Any) -> str:
    """The model arriving on an agent (bytes received of its copy), while or after it came."""
    if not isinstance(transfer, dict) or not transfer.get("total_bytes"):
        return ""
    done, total = int(transfer.get("done_bytes") or 0), int(transfer["total_bytes"])
    share = min(done / total, 1.0)
    label = f"{100 * share:.0f}% · {_gib(done)} of {_gib(total)}"
    return (
        f'<div class="memory transfer"><div class="label">model transfer<span>{label}</span>'
        f'</div><div class="track"><div class="fill ok" style="width:{100 * share:.1f}%">'
        "</div></div></div>"
    )


def _token_rates(samples: Sequence[Sample]) -> list[float]:
    rates = []
    for before, after in zip(samples, samples[1:], strict=False):
        elapsed = after.at - before.at
        produced = max(after.generated_tokens - before.generated_tokens, 0)
        rates.append(produced / elapsed if elapsed > 0 else 0.0)
    return rates


def _sparkline(values: Sequence[float]) -> str:
    if len(values) < 2:
        points = f"0,{CHART_HEIGHT} {CHART_WIDTH},{CHART_HEIGHT}"
    else:
        top = max(max(values), 1.0)
        step = CHART_WIDTH / (len(values) - 1)
        points = " ".join(
            f"{i * step:.1f},{CHART_HEIGHT - 2 - (CHART_HEIGHT - 4) * v / top:.1f}"
            for i, v in enumerate(values)
        )
    return (
        f'<svg viewBox="0 0 {CHART_WIDTH} {CHART_HEIGHT}" preserveAspectRatio="none">'
        f'<polyline points="{points}"/></svg>'
    )


def _gib(value: int | None) -> str:
    amount = value or 0
    return f"{amount / 2**30:.2f} GiB" if amount >= 2**28 else f"{amount / 2**20:.0f} MiB"


def _state_class(state: str) -> str:
    return {"ok": "ok", "starting": "warn", "degraded": "bad", "failed": "bad"}.get(state, "warn")
