"""ServeConfig: everything `tandem serve` was asked to do, as the coordinator receives it.

Its own module so that serve.py (the flags) and coordinator.py (the wiring) both use it
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from planner import Parallelism

from .http_limits import HttpLimits
from .observability import ObservabilityConfig

if TYPE_CHECKING:  # imported where it is built: importing engines/ binds the BLAS (blas.py)
    from engines.core.engine_options import EngineOptions


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything `tandem serve` was asked to do, from flags and their TANDEM_* twins."""

    model: str | None  # a directory or ORG/NAME[@REV]
    model_id: str | None
    parallelism: Parallelism
    host: str
    port: int
    queue_size: int
    # How every engine runs, as the flags asked (--max-batch, --kv-bits, ...); the launcher
    # adds what the plan decides.
    engine: EngineOptions
    prefix_cache_bytes: int | None  # None: derived by the planner from the memory left
    cpu_float32: bool
    max_tokens_cap: int
    request_timeout_s: float
    temperature: float | None  # for a request that sets none
    api_key: str | None
    interface: str | None
    discovery_timeout_s: float
    hostfile: Path | None
    cluster_key: str | None
    cluster_key_file: Path | None
    collective: str | None
    context_tokens: int
    memory_limit: str | None
    memory_budget: int | None
    lost_after_s: float
    rediscover_interval_s: float
    cache_dir: Path
    state_dir: Path
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    send_weights: bool = True
    max_body_bytes: int = 4 * 1024 * 1024
    http: HttpLimits = field(default_factory=HttpLimits)
    measure_speeds: str = "auto"  # auto | on | off (engines/cluster/speed_survey.py)
    draft_model: str | None = None  # --draft-model as given; resolved to engine's path per model
    engine_core: str = "process"  # process | thread (engines/cluster/launch.py)
    # --model-alias: (name or pattern, the served id it names; None: the first model)
    model_aliases: tuple[tuple[str, str | None], ...] = ()
    # every --model after the first: served beside it, placed over the cluster together
    more_models: tuple[str, ...] = ()
    load_on_demand: bool = False  # no model loads at start: the first request naming it does
    # --max-batch unset (engine.max_batch is the default): a full batch that does not fit is
    # planned as the largest that does
    shrink_batch: bool = False
    keep_alive_s: float = 0.0  # unload a model idle this long (it reloads on demand); 0: never
    chat_template: str | None = None  # --chat-template's text: the first model's chats use it
