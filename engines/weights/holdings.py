"""Planner inputs for weight transfers: what each agent holds of the model, and its sizes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from planner import NodeResources

log = logging.getLogger(__name__)


def with_holdings(
    nodes: Sequence[NodeResources],
    members: Sequence[Any],
    content_hash: Callable[[], str],
) -> list[NodeResources]:
    """`nodes` (the coordinator first) with what each holds: the coordinator the model, an
    agent the verified copies its model cache reports (discovery/model_cache.py).

    A repo-id model an agent may have in its own Hugging Face cache does not count: the
    agent cannot tell without hashing it, so the planner assumes it must receive the
    model (and so have the disk); likewise a model directory at the same path there. At
    assignment it still uses that copy and receives nothing.
    """
    caches = {member.node_id: member.model_cache for member in members}
    whole = None
    if any(cache is not None and cache.models for cache in caches.values()):
        whole = content_hash()  # only when some agent holds any copy: hashing reads the model
    planned = [replace(nodes[0], holds_model=True)] if nodes else []
    for node in nodes[1:]:
        cache = caches.get(node.node_id)
        copies = cache.models if cache is not None else []
        stages = tuple(
            (copy.layers[0], copy.layers[1])
            for copy in copies
            if copy.share_of == whole and len(copy.layers) == 2
        )
        ranks = tuple(
            (copy.tp_rank[0], copy.tp_rank[1])
            for copy in copies
            if copy.share_of == whole and len(copy.tp_rank) == 2
        )
        holds = any(copy.content_hash == whole and not copy.share_of for copy in copies)
        planned.append(replace(node, holds_model=holds, held_stages=stages, held_ranks=ranks))
    return planned
