"""Every covered mlx-lm architecture: the pipeline's stages, single, pp and tp give the same
greedy tokens, or the planner says by name why an engine cannot run it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.model.layers import pipeline_problem
from planner import Parallelism, decide
from tests.helpers.architectures import (
    CASES,
    Case,
    build,
    decision_inputs,
    refusal,
    run_pp,
    run_single,
    run_stage_chain,
    run_tp,
)

# The real engines cost a few worker processes per case (about 20 s with tp on this machine),
# so they run on two cases whose stage code differs most from llama's: sliding-window +
# global layers with a scaled, tied embedding and no tp; a quantized MoE.
# `python -m tests.bench.architectures_table` runs every case through every engine and
# writes docs/architectures.md.
ENGINE_CASES = (Case("gemma3_text"), Case("qwen3_moe", 4))


def case_id(case: Case) -> str:
    return case.name.replace(" ", "-")


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("architectures")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_stages_decode_like_the_single_engine(case: Case, models_root: Path) -> None:
    path, facts = build(case, models_root)
    assert facts.quantized == bool(case.quantize)
    assert facts.pipeline_problem == ""
    single = run_single(path)
    assert single.tokens is not None, single.error
    assert all(len(set(tokens)) >= 6 for tokens in single.tokens)  # varied: a real comparison
    chain = run_stage_chain(path, facts)
    assert chain.tokens == single.tokens, chain.error


@pytest.mark.cluster
@pytest.mark.parametrize("case", ENGINE_CASES, ids=case_id)
def test_single_pp_and_tp_engines_agree(case: Case, models_root: Path) -> None:
    path, facts = build(case, models_root)
    single = run_single(path)
    assert single.tokens is not None, single.error
    pp = run_pp(path, facts)
    assert pp.tokens == single.tokens, pp.error or pp.refusal
    tp = run_tp(path, facts)
    if facts.has_tp_variant:
        assert tp.tokens == single.tokens, tp.error or tp.refusal
    else:
        # mlx-lm has no Model.shard for it: explicit tp fails closed by name.
        assert tp.refusal is not None and "tensor-parallel variant" in tp.refusal


def test_an_architecture_the_pipeline_cannot_split_is_refused_by_name() -> None:
    problem = pipeline_problem({"model_type": "granite"})
    assert "'granite'" in problem and "scales embeddings" in problem
    mamba = {
        "model_type": "mamba",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "state_size": 16,
        "num_hidden_layers": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 8,
    }
    assert "'mamba'" in pipeline_problem(mamba)


def test_without_shard_the_planner_names_the_rule_and_auto_picks_pp(models_root: Path) -> None:
    _, facts = build(Case("phi3"), models_root)
    assert not facts.has_tp_variant
    assert "tensor-parallel variant" in (refusal(facts, Parallelism.TP) or "")
    assert refusal(facts, Parallelism.PP) is None
    auto = decide(decision_inputs(facts, Parallelism.AUTO))
    assert auto.chosen is Parallelism.PP and "tensor-parallel variant" in auto.reason
