"""`python -m engines.pipeline.stage_worker`: the stage worker process and its launcher.

The first line of stdin is a JSON spec (see StageSpec); stdout carries JSON lines only
({"event": "ready", ...} or {"event": "failed", ...}); logs go to stderr. The process serves
sessions (stage_server.py) until its stdin closes (the agent went away).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from mlx_lm.utils import load_config, load_tokenizer

from discovery.json_child import (
    ChildNotReady,
    JsonChild,
    configure_child_logging,
    open_protocol_output,
)
from discovery.secure_channel import SecureChannel
from engines.core import blas
from engines.decoding.grammar import GrammarCompiler
from engines.pipeline.chain_disk import ChainDiskTier, chain_disk_tier
from engines.pipeline.stage_model import StageModel
from engines.pipeline.stage_server import EncryptedPipelineServer
from engines.pipeline.stage_spec import StageSpec
from engines.weights.fetch import model_for_assignment, progress_events
from errors import ConfigError, EngineError, ModelError

log = logging.getLogger(__name__)

WORKER_MODULE = "engines.pipeline.stage_worker"
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class StageProcess:
    """A stage worker child process: its spec goes in on stdin; closing stdin stops it."""

    def __init__(self, child: JsonChild, port: int, peak_memory_bytes: int) -> None:
        self.child = child
        self.port = port
        self.peak_memory_bytes = peak_memory_bytes

    @property
    def pid(self) -> int | None:
        return self.child.pid

    @property
    def popen(self) -> subprocess.Popen[bytes] | None:
        return self.child.process

    @classmethod
    def start(
        cls,
        spec: dict[str, Any],
        *,
        stderr: Any = None,
        ready_timeout_s: float = 120.0,
        module: str = WORKER_MODULE,
        arguments: tuple[str, ...] = (),
    ) -> StageProcess:
        """Start `python -m module`, hand it `spec`, wait for its ready line (else EngineError)."""
        spec = {**spec, "model_path": str(Path(spec["model_path"]).resolve())}
        child = JsonChild(
            [sys.executable, "-m", module, *arguments],
            name=f"stage worker for layers {spec.get('layers')}",
            cwd=PROJECT_ROOT,
            stderr=stderr,
        )
        worker = cls(child, 0, 0)
        try:
            child.start(spec)
            event = child.wait_ready(ready_timeout_s)
            worker.port = int(event["port"])
            worker.peak_memory_bytes = int(event["peak_memory_bytes"])
        except (OSError, ChildNotReady, KeyError, TypeError, ValueError) as error:
            worker.stop()
            raise EngineError(f"{child.name} failed: {error}") from None
        return worker

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """Close stdin (the worker exits), then kill it if it has not within `timeout_s`."""
        return self.child.stop(timeout_s, ask=self.child.close_stdin)


def run(channel_class: Any = SecureChannel) -> int:
    """Read the spec from stdin, load the stage, report ready, serve; the exit status."""
    configure_child_logging("stage[%(process)d]")
    output = open_protocol_output()
    line = sys.stdin.buffer.readline()
    if not line:
        output.write({"event": "failed", "reason": "no stage spec on stdin"})
        return 2
    try:
        spec = StageSpec.from_json(line)
    except ConfigError as error:
        output.write({"event": "failed", "reason": str(error)})
        return 2
    log.info("BLAS: %s", blas.set_threads(spec.options.blas_threads).describe())
    try:
        model_path = model_for_assignment(
            spec.model_path, spec.weights, spec.cluster_key, progress_events(output)
        )
        options = spec.options
        stage = StageModel.load(
            model_path, spec.layers, spec.is_last, options.upcast, options.kv_bits,
            options.quantized_kv_start,
        )  # fmt: skip
        grammars = grammar_compiler(model_path, stage) if spec.is_last else None
        disk = stage_disk_tier(spec, model_path)
        server = EncryptedPipelineServer(spec, stage, channel_class, grammars, disk)
        port = server.bind()
    except (EngineError, ModelError, OSError) as error:
        output.write({"event": "failed", "reason": str(error)})
        return 1
    log.info(
        "stage [%d, %d) listening on %s:%d",
        spec.layers.start,
        spec.layers.stop,
        spec.listen_host,
        port,
    )
    output.write({"event": "ready", "port": port, "peak_memory_bytes": stage.peak_memory_bytes})
    try:
        server.serve(stop_fd=sys.stdin.fileno())
    finally:
        if disk is not None:
            disk.close()
    return 0


def stage_disk_tier(spec: StageSpec, model_path: Path) -> ChainDiskTier | None:
    """This stage's share of the prefix cache's disk tier, or None. Every session reopens it
    and adopts the files its coordinator names (chain_disk.py); it is opened once now, so that
    a directory this stage cannot use fails its start rather than its first session."""
    options = spec.options
    if not options.prefix_cache_disk_bytes or options.prefix_cache_dir is None:
        return None
    disk = chain_disk_tier(
        Path(options.prefix_cache_dir), model_path, spec.layers, options.kv_bits,
        options.quantized_kv_start,
    )  # fmt: skip
    disk.open()
    disk.close()
    return disk


def grammar_compiler(model_path: Path, stage: StageModel) -> GrammarCompiler | None:
    """The last stage's grammar compiler over the model's tokenizer, ready to use; None (each
    sequence with a grammar is then refused, the others served) when it cannot be built."""
    try:
        config = load_config(model_path)
        tokenizer = load_tokenizer(model_path, eos_token_ids=config.get("eos_token_id"))
        compiler = GrammarCompiler(tokenizer, max(stage.vocab_size, len(tokenizer)))
        compiler.prepare()  # now, not while the first constrained sequence's frame waits
    except Exception as error:  # noqa: BLE001 (any tokenizer failure costs grammars only)
        log.warning("no output grammars on this stage: cannot load the tokenizer: %s", error)
        return None
    return compiler


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
