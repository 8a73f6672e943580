"""The planner with a quantized KV cache: bytes per token by hand, more context in the same
memory, and a bad --kv-bits refused in one line."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import build_parser
from cli.serve import config_from_args
from errors import ConfigError, PlanError
from planner import ModelShape, NodeResources, Parallelism, plan_cluster, single_need
from tests.helpers.planning import MB, SHAPE

ROOT = Path(__file__).resolve().parents[2]
# The demo model's attention: 4 KV heads of 32, computed in float32.
DEMO = dataclasses.replace(SHAPE, kv_heads=4, head_dim=32, dtype_bytes=4)
BIG_HEADS = dataclasses.replace(SHAPE, kv_heads=8, head_dim=128)


@pytest.mark.parametrize(
    ("shape", "bits", "expected"),
    [
        # 2 (K and V) x kv_heads x (packed head_dim*bits/8 + scale and bias per group x dtype)
        pytest.param(SHAPE, 0, 2 * 8 * 64 * 2, id="64-dims-bf16-unquantized"),
        pytest.param(SHAPE, 8, 2 * 8 * (64 + 2 * 1 * 2), id="64-dims-8-bit-one-group"),
        pytest.param(SHAPE, 4, 2 * 8 * (32 + 2 * 1 * 2), id="64-dims-4-bit-one-group"),
        pytest.param(DEMO, 0, 2 * 4 * 32 * 4, id="demo-float32-unquantized"),
        pytest.param(DEMO, 8, 2 * 4 * (32 + 2 * 1 * 4), id="demo-8-bit-group-32"),
        pytest.param(DEMO, 4, 2 * 4 * (16 + 2 * 1 * 4), id="demo-4-bit-group-32"),
        pytest.param(BIG_HEADS, 8, 2 * 8 * (128 + 2 * 2 * 2), id="128-dims-8-bit-two-groups"),
        pytest.param(BIG_HEADS, 4, 2 * 8 * (64 + 2 * 2 * 2), id="128-dims-4-bit-two-groups"),
    ],
)
def test_kv_bytes_per_token_per_layer(shape: ModelShape, bits: int, expected: int) -> None:
    assert dataclasses.replace(shape, kv_bits=bits).kv_bytes_per_token_per_layer == expected


def test_bad_bits_or_an_ungroupable_head_are_refused() -> None:
    with pytest.raises(PlanError, match=r"one of \(4, 8\) or 0, got 3"):
        dataclasses.replace(SHAPE, kv_bits=3)
    with pytest.raises(PlanError, match="divisible by 32, got 48"):
        dataclasses.replace(SHAPE, head_dim=48, kv_bits=8)


def test_a_context_too_long_at_16_bits_fits_at_4() -> None:
    node = [NodeResources("a", "10.0.0.1", 100 * MB, ())]
    shapes = {bits: dataclasses.replace(SHAPE, kv_bits=bits) for bits in (0, 8, 4)}
    plans = {
        bits: plan_cluster(Parallelism.SINGLE, shape, node, context_tokens=1024, max_batch=1)
        for bits, shape in shapes.items()
    }
    assert plans[0].refusal is not None  # 34 MB of weights + 64 MB of KV, with headroom
    assert plans[8].refusal is None and plans[4].refusal is None
    assert plans[4].fits[0].need_bytes < plans[8].fits[0].need_bytes < plans[0].fits[0].need_bytes
    lines = "\n".join(plans[4].describe())
    assert "KV cache: 4-bit, 18.0 KB per token" in lines  # 576 bytes x 32 layers
    assert plans[4].to_dict()["kv_bytes_per_token"] == 576 * 32


def test_auto_prefix_cache_holds_more_tokens_at_fewer_bits() -> None:
    nodes = [NodeResources("a", "10.0.0.1", 2 << 30, ())]
    tokens = {}
    for bits in (0, 8, 4):
        shape = dataclasses.replace(SHAPE, kv_bits=bits)
        plan = plan_cluster(Parallelism.SINGLE, shape, nodes, prefix_cache_bytes=None)
        tokens[bits] = plan.prefix_cache_bytes // plan.kv_bytes_per_token
    assert tokens[4] > tokens[8] > tokens[0]
    # more than the per-token ratio: the batch's own KV shrinks too, leaving more memory
    assert tokens[4] / tokens[0] > 2048 / 576


def test_serve_refuses_bad_kv_bits_and_takes_good_ones() -> None:
    def config(*flags: str):
        key = ["--cluster-key", "tandem-" + "A" * 43]
        return config_from_args(build_parser().parse_args(["serve", *key, *flags]))

    assert [config("--kv-bits", v).engine.kv_bits for v in ("8", "4", "off")] == [8, 4, 0]
    assert config().engine.kv_bits == 0
    for bad in ("3", "16", "eight"):
        with pytest.raises(ConfigError, match=f"--kv-bits must be 8, 4 or off, got '{bad}'"):
            config("--kv-bits", bad)


def test_tandem_plan_with_bad_kv_bits_says_so_in_one_line_and_fails(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cli.main", "plan", "--kv-bits", "2",
         "--state-dir", str(tmp_path / "state"), "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode != 0
    assert result.stderr.strip() == "tandem: error: --kv-bits must be 8, 4 or off, got '2'"


@pytest.mark.parametrize(
    ("start", "expected_tokens"),
    [
        # a sequence of 1000 tokens; full: 1024 bytes per token per layer (demo float32),
        # 8-bit: 320; the plan counts tokens of 320 bytes
        pytest.param(0, 1000, id="quantized-from-the-first-pass"),
        pytest.param(5000, 1000 * 1024 // 320, id="all-under-the-threshold"),
        pytest.param(400, (400 * 1024 + 600 * 320) // 320, id="the-first-400-in-full"),
    ],
)
def test_kv_under_the_threshold_is_counted_in_full_precision(start: int, expected_tokens: int):
    """A sequence's first quantized_kv_start tokens cost full precision, the rest quantized."""
    shape = dataclasses.replace(DEMO, kv_bits=8, quantized_kv_start=start)
    assert shape.sequence_kv_bytes_per_layer(1000) == expected_tokens * 320
    node = [NodeResources("a", "10.0.0.1", 1 << 40, ())]
    plan = plan_cluster(Parallelism.SINGLE, shape, node, context_tokens=1000, max_batch=2)
    assert plan.fits[0].need_bytes == single_need(shape, 2 * expected_tokens)
    assert plan.to_dict()["quantized_kv_start"] == start
    if start:
        assert f"once a sequence holds {start} tokens" in "\n".join(plan.describe())


def test_prefix_cache_tokens_are_priced_in_full_precision_under_a_threshold() -> None:
    nodes = [NodeResources("a", "10.0.0.1", 2 << 30, ())]
    plans = {
        start: plan_cluster(
            Parallelism.SINGLE,
            dataclasses.replace(SHAPE, kv_bits=4, quantized_kv_start=start),
            nodes,
            prefix_cache_bytes=64 * MB,
        )
        for start in (0, 5000)
    }
    assert plans[0].prefix_cache_bytes == 64 * MB // (576 * 32) * 576 * 32
    full = 2 * 8 * 64 * 2 * 32  # bf16 heads of 64, 32 layers
    assert plans[5000].prefix_cache_bytes == 64 * MB // full * full
    assert f"(~{64 * MB // full} tokens)" in "\n".join(plans[5000].describe())


def test_serve_takes_a_quantized_kv_start_and_refuses_a_bad_one() -> None:
    def config(*flags: str):
        key = ["--cluster-key", "tandem-" + "A" * 43]
        return config_from_args(build_parser().parse_args(["serve", *key, *flags]))

    assert config().engine.quantized_kv_start == 5000  # mlx_lm.server's default
    assert config("--quantized-kv-start", "0").engine.quantized_kv_start == 0
    for bad in ("-1", "many"):
        with pytest.raises(
            ConfigError, match=f"--quantized-kv-start must be 0 or more tokens, got '{bad}'"
        ):
            config("--quantized-kv-start", bad)
