"""StageAddress: where a remote pipeline stage listens, with the layers it must report and the
member that runs it. The engine takes it or the mapping the cluster launcher builds; when a
stage is lost, the error names every stage by its address.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StageAddress:
    """Where a remote stage listens; `layers` (optional) is checked against what it reports."""

    host: str
    port: int
    layers: range | None = None
    node: str = ""  # the member running it, named in failure messages

    @classmethod
    def of(cls, value: StageAddress | Mapping[str, Any]) -> StageAddress:
        if isinstance(value, StageAddress):
            return value
        layers = value.get("layers")
        return cls(
            str(value["host"]),
            int(value["port"]),
            range(*layers) if layers else None,
            str(value.get("node", "")),
        )

    def describe(self, index: int) -> str:
        layers = f" (layers [{self.layers.start}, {self.layers.stop}))" if self.layers else ""
        node = f" on node {self.node}" if self.node else ""
        return f"stage {index}{layers}{node} at {self.host}:{self.port}"
