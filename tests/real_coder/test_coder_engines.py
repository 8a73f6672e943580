"""Qwen2.5-Coder-0.5B-Instruct from its real GGUF: the import keeps its K-quants and Q5_0, the
CPU kernel gives mlx's own greedy tokens, and every engine gives mlx-lm's: single (with the
prefix cache and a quantized KV cache), a two-stage sealed pipeline speculating by prompt
lookup, and two tensor-parallel ranks on a ring (14 heads over 2 KV heads split for real)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from discovery.cluster_key import generate_key
from engines.core.engine import Engine
from engines.core.engine_options import EngineOptions
from engines.core.runner import EngineRunner
from engines.model.info import inspect_model
from engines.single.engine import SingleEngine
from engines.tensor_parallel import TensorParallelEngine, loopback_ring_specs
from errors import ModelError
from planner import NodeResources, Parallelism, allocate_layers, plan_cluster
from tests.helpers.engine import run_one
from tests.helpers.pipeline import make_engine, start_workers, stop_workers
from tests.helpers.real_model import Greedy, engine_request
from tests.helpers.tensor_parallel import start_rank, stop_processes
from tests.real_coder.conftest import CODER, CODER_QUESTIONS

pytestmark = pytest.mark.cluster

GIB = 1024**3
LOAD_TIMEOUT_S = 180.0
STEP_TIMEOUT_S = 120.0
DRAFTED = 4


def answers_of(engine: Engine) -> list[Greedy]:
    runner = EngineRunner(engine)
    try:
        runner.start(LOAD_TIMEOUT_S)
        got = [run_one(runner, engine_request(engine.tokenizer, q)) for q in CODER_QUESTIONS]
        return [Greedy(tuple(g.tokens), g.text, g.finish) for g in got]
    finally:
        runner.close()


def test_the_import_keeps_every_quantization_of_the_gguf(qwen_dir: Path) -> None:
    config = json.loads((qwen_dir / "config.json").read_text())
    quantization = config["quantization"]  # the default (Q5_0's), then each other layer's
    bits = {spec["bits"] for spec in quantization.values() if isinstance(spec, dict)}
    # Q5_0 and Q4_K as they are; Q8_0 as 8 bits; Q6_K requantized to 8 (6 would double its error)
    if CODER.model_id == "qwen2.5-coder-0.5b-instruct":
        assert (quantization["bits"], bits) == (5, {4, 8})
        assert (config["num_attention_heads"], config["num_key_value_heads"]) == (14, 2)
    else:  # the 1.5B: Q4_K with Q6_K
        assert (quantization["bits"], bits) == (4, {8})
        assert (config["num_attention_heads"], config["num_key_value_heads"]) == (12, 2)


def test_scales_are_float16_where_that_holds_the_gguf_s_own_values(qwen_dir: Path) -> None:
    """With tandem's kernel: Q8_0/Q5_0 layers' scales and biases in float16, their values
    still the GGUF's exactly; K-quants' (products of a float16 and a 6-bit scale) and the
    embedding's (its rows start the residual stream) in float32; Q6_K re-quantized in float16."""
    import mlx.core as mx
    from gguf import quants

    from engines import kernels
    from engines.model.gguf.architectures import find_architecture
    from engines.model.gguf.source import open_source
    from engines.model.pypi_models import QWEN_CODER_0_5B
    from tests.helpers.real_models import real_gguf

    if kernels.load() is None:
        pytest.skip(f"tandem's CPU kernel is not built here: {kernels.unavailable_reason()}")
    weights: dict[str, mx.array] = {}
    for shard in qwen_dir.glob("*.safetensors"):
        weights.update(mx.load(str(shard)))
    source = open_source(real_gguf(CODER))
    architecture = find_architecture(source.architecture)
    expected = {"Q8_0": mx.float16, "Q5_0": mx.float16, "Q6_K": mx.float16, "Q4_K": mx.float32}
    seen = set()
    for name, tensor in source.tensors.items():
        if not name.endswith(".weight"):
            continue  # biases of a layer stay float
        try:
            module = architecture.mlx_name(name).rsplit(".", 1)[0]
        except ModelError:
            continue  # tensors the config takes (rope factors), not weights
        if f"{module}.scales" not in weights:
            continue  # a float tensor
        kind = tensor.tensor_type.name
        want = mx.float32 if module == "model.embed_tokens" else expected[kind]
        assert weights[f"{module}.scales"].dtype == want, (name, kind)
        assert weights[f"{module}.biases"].dtype == want, (name, kind)
        seen.add(kind)
        # Values kept exactly: the head and layer 0's up projection against gguf-py's own.
        if name in ("output.weight", "blk.0.ffn_up.weight") and kind in ("Q8_0", "Q5_0"):
            theirs = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
            ours = mx.dequantize(  # in float32, as the kernel computes s * q + b
                weights[f"{module}.weight"], weights[f"{module}.scales"].astype(mx.float32),
                weights[f"{module}.biases"].astype(mx.float32), group_size=32,
                bits=8 if kind == "Q8_0" else 5,
            )  # fmt: skip
            assert np.array_equal(np.array(ours), theirs), name
    assert {"Q8_0", "Q5_0", "Q4_K", "Q6_K"} <= seen or CODER != QWEN_CODER_0_5B


def test_the_cpu_kernel_gives_mlx_quantized_matmul_greedy_tokens(qwen_dir: Path) -> None:
    """mlx-lm's generate on the kernel and on mlx's own quantized matmul, which prefills slowly
    on the CPU: a short raw prompt, 16 greedy tokens of code."""
    from mlx_lm import load, stream_generate

    from engines.model.packed_quantized import pack

    model, tokenizer = load(str(qwen_dir))
    prompt = tokenizer.encode("def fibonacci(n):\n")

    def greedy() -> list[int]:
        return [int(r.token) for r in stream_generate(model, tokenizer, prompt, max_tokens=16)]

    theirs = greedy()
    (model,) = pack(model)
    assert type(model.model.layers[0].mlp.down_proj).__name__ != "QuantizedLinear"  # swapped
    assert greedy() == theirs and len(theirs) == 16


def test_mlx_lm_answers_right(coder_answers: list[Greedy]) -> None:
    for question, answer in zip(CODER_QUESTIONS, coder_answers, strict=True):
        assert question.answer in answer.text and answer.finish == "stop", answer


def test_the_single_engine_gives_mlx_lm_tokens_with_its_prefix_cache_and_kv_bits(
    qwen_dir: Path, coder_answers: list[Greedy]
) -> None:
    engine = SingleEngine(qwen_dir, EngineOptions(prefix_cache_bytes=64 * 1024**2))
    runner = EngineRunner(engine)
    try:
        runner.start(LOAD_TIMEOUT_S)
        for _ in range(2):  # the second time each prompt is in the prefix cache
            for question, expected in zip(CODER_QUESTIONS, coder_answers, strict=True):
                got = run_one(runner, engine_request(engine.tokenizer, question))
                assert (tuple(got.tokens), got.text) == (expected.tokens, expected.text)
        assert engine.info().detail["prefix_cache"]["hits"] >= len(CODER_QUESTIONS)
    finally:
        runner.close()
    # an 8-bit KV cache changes the numbers a little, never the answer on this text
    quantized_kv = answers_of(SingleEngine(qwen_dir, EngineOptions(kv_bits=8)))
    for question, answer in zip(CODER_QUESTIONS, quantized_kv, strict=True):
        assert question.answer in answer.text, answer


def test_a_two_stage_pipeline_speculating_gives_mlx_lm_tokens(
    qwen_dir: Path, coder_answers: list[Greedy], tmp_path: Path
) -> None:
    layers = json.loads((qwen_dir / "config.json").read_text())["num_hidden_layers"]
    ranges = allocate_layers(layers, [8 * GIB, 8 * GIB])
    key = generate_key()
    listener, workers = start_workers(qwen_dir, ranges, key, tmp_path, STEP_TIMEOUT_S)
    engine = make_engine(
        qwen_dir, ranges, key, listener, workers, token_timeout_s=STEP_TIMEOUT_S,
        most_drafted=DRAFTED,
    )  # fmt: skip
    try:
        assert answers_of(engine) == coder_answers
        speculation = engine.info().detail["speculation"]
        assert speculation["accepted"] > 0, speculation  # the code copies its question
    finally:
        engine.close()
        stop_workers(workers)


def test_two_tensor_parallel_ranks_split_it_and_give_mlx_lm_tokens(
    qwen_dir: Path, coder_answers: list[Greedy]
) -> None:
    shape = inspect_model(qwen_dir).to_shape()
    nodes = [NodeResources(f"node{r}", f"10.0.0.{r + 1}", 8 * GIB, ("ring",)) for r in range(2)]
    plan = plan_cluster(Parallelism.TP, shape, nodes, collective="ring")
    assert (plan.decision.chosen, plan.refusal) == (Parallelism.TP, None)  # 2 KV heads split
    specs = loopback_ring_specs(2, qwen_dir, stall_timeout_s=STEP_TIMEOUT_S)
    ranks = [start_rank(spec) for spec in specs[1:]]
    lost: list[str] = []
    engine = TensorParallelEngine(
        qwen_dir, specs[0], on_lost=lost.append, load_timeout_s=LOAD_TIMEOUT_S,
        token_timeout_s=STEP_TIMEOUT_S,
    )  # fmt: skip
    try:
        assert answers_of(engine) == coder_answers
        assert not lost
    finally:
        engine.close()
        stop_processes(ranks)


def test_serve_takes_it_by_name_from_the_cache(qwen_dir: Path, qwen_cache: Path) -> None:
    """`--model qwen2.5-coder-0.5b-instruct`: the fetched GGUF (here the suite's, linked into
    this cache) and its import, served under that name."""
    import os

    from cli.model_source import resolve_model
    from cli.served_model import default_model_id
    from tests.helpers.real_models import real_gguf

    cached = CODER.gguf_path(qwen_cache)
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        os.link(real_gguf(CODER), cached)
    facts = resolve_model(CODER.model_id, qwen_cache)
    assert facts.path == qwen_dir  # imported once, keyed by the file's sha256
    assert default_model_id(CODER.model_id, facts) == CODER.model_id
