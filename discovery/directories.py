"""Where tandem keeps things on a machine: its cache (models, keys) and its state (node id)."""

from __future__ import annotations

from pathlib import Path


def default_cache_dir() -> Path:
    """~/.cache/tandem: demo models and weights received from a coordinator."""
    return Path.home() / ".cache" / "tandem"


def default_state_dir() -> Path:
    """~/.local/state/tandem: what a node keeps across restarts (its node id)."""
    return Path.home() / ".local" / "state" / "tandem"
