"""What an output grammar (JSON mode) costs per token: single and tp=2, with and without.

Run from the project root: `python -m tests.bench.bench_grammar` (about a minute). Every
contender decodes the same prompt greedily on the default demo model, in interleaved rounds;
it also times a rank's first grammar (its tokenizer load) and a later one. It prints a
markdown table (quoted in docs/tensor_parallel.md, "Grammars").
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from llguidance import LLMatcher

from engines.api.constraints import ANY_OBJECT, JSON_OPTIONS
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.model.demo import ensure_demo_model
from engines.single.engine import SingleEngine
from engines.tensor_parallel.rank_grammar import RankGrammars
from tests.bench.common import markdown_table
from tests.bench.tp_cluster import open_tensor_parallel_runner
from tests.helpers.engine import run_one

MODEL_CACHE = Path(tempfile.gettempdir()) / "tandem-bench"
PROMPT = "The quick brown fox"
MAX_TOKENS = 32
ROUNDS = 8
GRAMMAR = LLMatcher.grammar_from_json_schema(ANY_OBJECT, overrides=JSON_OPTIONS)


def seconds_per_token(runner: EngineRunner, grammar: str | None) -> float:
    """One request, prefill included, over the tokens it generated."""
    prompt = tuple(runner.engine.tokenizer.encode(PROMPT))
    started = time.perf_counter()
    outcome = run_one(runner, GenerationRequest("bench", prompt, MAX_TOKENS, grammar=grammar))
    return (time.perf_counter() - started) / len(outcome.tokens)


def main() -> None:
    model_path = ensure_demo_model(MODEL_CACHE)
    grammars = RankGrammars(model_path, 0)
    compiles = []
    for _ in range(2):
        started = time.perf_counter()
        grammars.processor(GRAMMAR)
        compiles.append(time.perf_counter() - started)
    single = EngineRunner(SingleEngine(model_path))
    single.start(60)
    try:
        with open_tensor_parallel_runner(model_path, 2) as tp:
            contenders = {
                (name, label): (runner, grammar)
                for name, runner in (("single", single), ("tp=2", tp))
                for label, grammar in (("free", None), ("JSON mode", GRAMMAR))
            }
            times: dict[tuple[str, str], list[float]] = {key: [] for key in contenders}
            for round_ in range(ROUNDS + 1):  # interleaved; round 0 warms up
                for key, (runner, grammar) in contenders.items():
                    elapsed = seconds_per_token(runner, grammar)
                    if round_:
                        times[key].append(elapsed)
    finally:
        single.close()
    rows = [
        [f"{name}, {label}", f"{statistics.median(values) * 1e3:.1f}"]
        for (name, label), values in times.items()
    ]
    print(markdown_table(["contender", "ms per token (median)"], rows))
    print(f"\nfirst grammar on a rank (tokenizer load + compile): {compiles[0] * 1e3:.0f} ms")
    print(f"a later grammar (compile only): {compiles[1] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
