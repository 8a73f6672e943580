"""`tandem status`: the cluster at a glance, from a running server's /v1/cluster and /metrics."""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from typing import Any

from errors import PeerError

from .options import add_flag

DEFAULT_URL = "http://127.0.0.1:8000"
TIMEOUT_S = 5.0
MODEL_LABEL = "model"  # every model's series carry it (engines/api/cluster_metrics.py)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="show a running server's cluster at a glance")
    add_flag(parser, "--url", default=DEFAULT_URL, help="the server's base URL")
    add_flag(parser, "--api-key", help="the server's --api-key, if it has one")
    add_flag(
        parser,
        "--sample",
        default=1.0,
        cast=float,
        help="seconds between two /metrics scrapes for the live tokens/s (0: one scrape)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    base = args.url.rstrip("/")
    cluster = json.loads(fetch(f"{base}/v1/cluster", args.api_key))
    first = parse_metrics(fetch(f"{base}/metrics", args.api_key))
    tokens_per_s = None
    if args.sample > 0:
        time.sleep(args.sample)
        second = parse_metrics(fetch(f"{base}/metrics", args.api_key))
        produced = second.get("tandem_generated_tokens_total", 0) - first.get(
            "tandem_generated_tokens_total", 0
        )
        tokens_per_s, first = max(produced, 0) / args.sample, second
    print("\n".join(describe(base, cluster, first, tokens_per_s)))
    return 0


def fetch(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S
        ) as response:
            return response.read().decode()
    except urllib.error.HTTPError as error:
        hint = "; pass --api-key" if error.code == 401 else ""
        raise PeerError(f"{url} answered {error.code}{hint}") from None
    except (OSError, ValueError) as error:
        raise PeerError(f"cannot reach {url}: {error}; is `tandem serve` running?") from None


def parse_metrics(text: str, model: str | None = None) -> dict[str, float]:
    """Sample name (with its labels but `model`, if any, as `name{a="b"}`) → value: the
    samples of `model`, or without one every model's added up (the whole server's)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if model is not None and labels.get(MODEL_LABEL, model) != model:
                continue
            labels.pop(MODEL_LABEL, None)
            pairs = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            key = f"{sample.name}{{{pairs}}}" if pairs else sample.name
            values[key] = values.get(key, 0.0) + sample.value
    return values


def describe(
    base: str, cluster: dict[str, Any], metrics: dict[str, float], tokens_per_s: float | None
) -> list[str]:
    """The server at a glance: its traffic over every model (`metrics` as parse_metrics
    adds them up); the default model's plan; with several models, a line for each."""
    models = cluster.get("models") or {}
    default = f" (of {next(iter(models))}, the default model)" if len(models) > 1 else ""
    lines = [
        f"tandem at {base}: {cluster.get('state')}",
        f"strategy  {cluster.get('strategy')} — {cluster.get('reason')}{default}",
        f"batch     {int(metrics.get('tandem_active_sequences', 0))}/"
        f"{int(metrics.get('tandem_batch_capacity', 0))} active, "
        f"{int(metrics.get('tandem_queue_depth', 0))}/"
        f"{int(metrics.get('tandem_queue_capacity', 0))} queued",
    ]
    finished = {
        key.split('"')[1]: int(value)
        for key, value in metrics.items()
        if key.startswith("tandem_requests_finished_total{")
    }
    count = metrics.get("tandem_request_duration_seconds_count", 0)
    mean = metrics.get("tandem_request_duration_seconds_sum", 0) / count if count else 0.0
    rate = f"{tokens_per_s:.1f} tokens/s now, " if tokens_per_s is not None else ""
    by_reason = ", ".join(f"{k} {v}" for k, v in sorted(finished.items())) or "none yet"
    lines.append(
        f"traffic   {rate}{int(metrics.get('tandem_generated_tokens_total', 0))} tokens, "
        f"{int(count)} requests ({by_reason}), mean {mean:.2f} s"
    )
    steps = engine_steps(metrics)
    if steps:
        lines.append(f"steps     {steps}")
    lines.append(f"re-plans  {cluster.get('replans', 0)} {cluster.get('last_replan_reason') or ''}")
    if len(models) > 1:
        lines += ["", *describe_models(models)]
    lines.append("")
    lines.append(f"{'NODE':<28} {'STATE':<12} {'MEMORY':>10} {'TIER':<8} {'HEARTBEAT':>9} WORKER")
    coordinator = cluster.get("coordinator") or {}
    nodes = [{**coordinator, "state": "coordinator"}, *(cluster.get("members") or [])]
    for node in nodes:
        age = node.get("last_heartbeat_age_s")
        lines.append(
            f"{str(node.get('node_id')):<28} {str(node.get('state')):<12} "
            f"{(node.get('memory_available') or 0) / 2**30:>7.1f} GB "
            f"{str(node.get('memory_tier') or '-'):<8} "
            f"{'-' if age is None else f'{age:.1f} s':>9} {node.get('worker_state') or '-'}"
            + _receiving(node.get("transfer"))
        )
    return lines


def describe_models(models: dict[str, dict[str, Any]]) -> list[str]:
    """One line per served model: its state, its plan's strategy and nodes, its batch."""
    lines = [f"{'MODEL':<28} {'STATE':<12} {'STRATEGY':<9} {'NODES':<28} BATCH"]
    for model_id, each in models.items():
        status = each if isinstance(each, dict) else {}
        ranks = [str(rank) for rank in (status.get("plan") or {}).get("ranks") or ()]
        nodes = ", ".join(ranks) or "-"
        if status.get("relayed") and len(ranks) == 2:
            nodes = f"{ranks[1]} (relayed by {ranks[0]})"
        batch = (status.get("engine") or {}).get("batch") or {}
        load = (
            f"{batch.get('active', 0)}/{batch.get('capacity', 0)} active, "
            f"{batch.get('queued', 0)} queued"
            if batch
            else "-"
        )
        lines.append(
            f"{model_id:<28} {str(status.get('state') or '-'):<12} "
            f"{str(status.get('strategy') or '-'):<9} {nodes:<28} {load}"
        )
    return lines


def _receiving(transfer: Any) -> str:
    """ ", receiving the model 45%" while a model transfer to the node is under way."""
    if not isinstance(transfer, dict) or not transfer.get("total_bytes"):
        return ""
    done, total = int(transfer.get("done_bytes") or 0), int(transfer["total_bytes"])
    return f", receiving the model {100 * done / total:.0f}%" if done < total else ""


def engine_steps(metrics: dict[str, float]) -> str:
    """The mean of each engine step segment (tp all_sum ..., pp stages and sealing), or ""."""
    prefix = 'tandem_engine_step_seconds_count{segment="'
    means = []
    for key, count in metrics.items():
        if key.startswith(prefix) and count:
            segment = key[len(prefix) : -2]
            total = metrics.get(f'tandem_engine_step_seconds_sum{{segment="{segment}"}}', 0.0)
            means.append(f"{segment} {total / count * 1000:.2f}")
    if not means:
        return ""
    steps = int(metrics.get("tandem_engine_steps_total", 0))
    return f"{', '.join(means)} ms (mean of {steps} steps)"
