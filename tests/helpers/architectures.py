"""Run one tiny demo model of an architecture through single, pp and tp; compare greedy tokens.

Shared by tests/model/test_architectures.py and tests/bench/architectures_table.py (which writes
docs/architectures.md from the same checks).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from discovery.cluster_key import generate_key
from engines.core.runner import EngineRunner
from engines.model.demo import ensure_demo_model
from engines.model.demo_spec import DemoSpec
from engines.model.info import ModelFacts, inspect_model
from engines.single.engine import SingleEngine
from planner import DecisionInputs, Parallelism, capability_checks, decide
from tests.helpers.engine import make_request, run_one

PROMPTS = (
    "Once upon a time",
    # Longer than the demo's 16-token sliding window, so windowed layers drop old positions.
    "In the beginning the model read a long prompt, sentence after sentence, and then it",
)
MAX_TOKENS = 24
LOAD_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Case:
    """One row of the table: an architecture, optionally quantized."""

    arch: str
    quantize: int | None = None

    @property
    def name(self) -> str:
        return f"{self.arch} {self.quantize}-bit" if self.quantize else self.arch

    def spec(self) -> DemoSpec:
        # Tiny: 2 layers, hidden 64, 4 heads over 2 KV heads (every rule holds for 2 ranks).
        return DemoSpec(
            arch=self.arch, layers=2, heads=4, kv_heads=2, hidden=64, quantize=self.quantize
        )


CASES = (
    Case("llama"),
    Case("mistral"),
    Case("qwen2"),
    Case("qwen3"),
    Case("qwen3_moe"),
    Case("gemma3_text"),
    Case("phi3"),
    Case("gpt_oss"),
    Case("deepseek_v3"),
    Case("llama", 4),
    Case("qwen3", 8),
    Case("qwen3_moe", 4),
    Case("gemma3_text", 4),
)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one engine did with a case: its tokens per prompt, or why it did not run."""

    tokens: tuple[tuple[int, ...], ...] | None = None
    refusal: str | None = None  # the planner's reason (the engine cannot run the model)
    error: str | None = None  # it should have run and failed


def build(case: Case, root: Path) -> tuple[Path, ModelFacts]:
    path = ensure_demo_model(root, case.spec())
    return path, inspect_model(path)


def greedy(runner: EngineRunner) -> tuple[tuple[int, ...], ...]:
    outputs = []
    for prompt in PROMPTS:
        outcome = run_one(runner, make_request(runner.engine, prompt, MAX_TOKENS))
        if outcome.error:
            raise RuntimeError(outcome.error)
        outputs.append(tuple(outcome.tokens))
    return tuple(outputs)


def decision_inputs(facts: ModelFacts, choice: Parallelism) -> DecisionInputs:
    """Two nodes with a collective backend: only the model decides what can run."""
    return DecisionInputs(
        operator_choice=choice,
        world_size=2,
        attention_heads=facts.attention_heads,
        kv_heads=facts.kv_heads,
        has_tp_variant=facts.has_tp_variant,
        distributed_group_available=True,
        intermediate_size=facts.intermediate_size,
        pipeline_problem=facts.pipeline_problem,
    )


def refusal(facts: ModelFacts, choice: Parallelism) -> str | None:
    """The planner's reason for not running `choice` over two nodes, or None when it would."""
    inputs = decision_inputs(facts, choice)
    decision = decide(inputs)
    if decision.chosen is choice:
        return None
    failed = [c for c in capability_checks(inputs) if not c.passed]
    return "; ".join(f"{check.name}: {check.detail}" for check in failed) or decision.reason


def run_engine(runner_factory: Callable[[], tuple[EngineRunner, Callable[[], None]]]) -> Outcome:
    try:
        runner, close = runner_factory()
    except Exception as error:  # noqa: BLE001 - recorded in the table, asserted by the tests
        return Outcome(error=f"{type(error).__name__}: {error}")
    try:
        return Outcome(tokens=greedy(runner))
    except Exception as error:  # noqa: BLE001
        return Outcome(error=f"{type(error).__name__}: {error}")
    finally:
        close()


def run_single(path: Path) -> Outcome:
    def factory() -> tuple[EngineRunner, Callable[[], None]]:
        runner = EngineRunner(SingleEngine(path))
        runner.start(LOAD_TIMEOUT_S)
        return runner, runner.close

    return run_engine(factory)


def run_stage_chain(path: Path, facts: ModelFacts, prefill_chunk: int = 8) -> Outcome:
    """Two StageModels in this process, driven as the pipeline's stages drive them.

    Each prompt is prefilled alone in chunks on per-sequence batch caches, then the prompts
    decode together in one micro-batch (caches merged, left-padded), greedy on the last
    stage's log-probabilities. No sockets or processes: this checks the stage model itself.
    """
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer

    from engines.pipeline.stage_model import StageModel

    if reason := refusal(facts, Parallelism.PP):
        return Outcome(refusal=reason)
    try:
        tokenizer = load_tokenizer(path)
        stages = [
            StageModel.load(path, range(0, 1), is_last=False),
            StageModel.load(path, range(1, facts.num_layers), is_last=True),
        ]
        batch: list[list] | None = None
        last: list[int] = []
        outputs: list[list[int]] = []
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            caches = [[type(c).merge([c]) for c in stage.make_cache()] for stage in stages]
            for start in range(0, len(ids), prefill_chunk):
                hidden = stages[0].embed(mx.array([ids[start : start + prefill_chunk]]))
                for stage, cache in zip(stages, caches, strict=True):
                    hidden = stage.forward(hidden, cache)
            token = int(mx.argmax(stages[-1].logits(hidden), axis=-1).item())
            outputs.append([token])
            last.append(token)
            if batch is None:
                batch = caches
            else:
                for held, newcomer in zip(batch, caches, strict=True):
                    for cache, other in zip(held, newcomer, strict=True):
                        cache.extend(other)
        while len(outputs[0]) < MAX_TOKENS:
            hidden = stages[0].embed(mx.array([[token] for token in last]))
            for stage, cache in zip(stages, batch, strict=True):
                hidden = stage.forward(hidden, cache)
            last = mx.argmax(stages[-1].logits(hidden), axis=-1).tolist()
            for output, token in zip(outputs, last, strict=True):
                output.append(token)
    except Exception as error:  # noqa: BLE001 - recorded in the table, asserted by the tests
        return Outcome(error=f"{type(error).__name__}: {error}")
    return Outcome(tokens=tuple(tuple(output) for output in outputs))


def run_pp(path: Path, facts: ModelFacts) -> Outcome:
    """Two stages: layer 0 here, layer 1 in a real stage worker process over a sealed hop."""
    from tests.helpers.pipeline import make_engine, start_workers, stop_workers

    if reason := refusal(facts, Parallelism.PP):
        return Outcome(refusal=reason)
    ranges = [range(0, 1), range(1, facts.num_layers)]

    def factory() -> tuple[EngineRunner, Callable[[], None]]:
        key = generate_key()
        log_dir = Path(tempfile.mkdtemp(prefix="tandem-arch-pp-"))
        listener, workers = start_workers(path, ranges, key, log_dir)
        engine = make_engine(path, ranges, key, listener, workers)
        runner = EngineRunner(engine)

        def close() -> None:
            runner.close()
            engine.close()
            stop_workers(workers)

        try:
            runner.start(LOAD_TIMEOUT_S)
        except BaseException:
            close()
            raise
        return runner, close

    return run_engine(factory)


def run_tp(path: Path, facts: ModelFacts) -> Outcome:
    """Two ranks over the TCP ring on loopback, each a real worker process."""
    from tests.helpers.tensor_parallel import close_cluster, open_cluster

    if reason := refusal(facts, Parallelism.TP):
        return Outcome(refusal=reason)

    def factory() -> tuple[EngineRunner, Callable[[], None]]:
        cluster = open_cluster(path)
        runner = EngineRunner(cluster.engine)

        def close() -> None:
            runner.close()
            close_cluster(cluster)

        try:
            runner.start(LOAD_TIMEOUT_S)
        except BaseException:
            close()
            raise
        return runner, close

    return run_engine(factory)
