"""Pipeline parallel with sealed hand-offs: stage 0 here, the other stages in stage workers.

The stage worker (`python -m engines.pipeline.stage_worker`, StageSpec, StageProcess,
EncryptedPipelineServer) is not imported here so that running it as a module stays clean.
"""

from engines.pipeline.engine import EncryptedPipelineEngine
from engines.pipeline.stage_address import StageAddress

__all__ = ["EncryptedPipelineEngine", "StageAddress"]
