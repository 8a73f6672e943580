"""Linear layers weights first (engines/model/gemm_layout.py): the same rows, chosen by timing."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.utils import load

from engines.core import blas
from engines.core.blas import LAYOUT_ENV
from engines.core.engine_options import EngineOptions
from engines.core.runner import EngineRunner
from engines.model import gemm_layout
from engines.model.gemm_layout import (
    SMALLEST_WEIGHT,
    WeightsFirstLinear,
    faster_rows,
    lay_out,
)
from engines.single.engine import SingleEngine
from tests.helpers.engine import make_request, run_all


def scripted(gains: dict[int, float]):
    """A timer under which weights first is `gains[rows]` times faster (1.0 elsewhere)."""
    return lambda weight, rows: (gains.get(rows, 1.0), 1.0)


def swapped(module: nn.Module) -> int:
    return sum(isinstance(layer, WeightsFirstLinear) for _, layer in module.named_modules())


@pytest.mark.parametrize("bias", [False, True])
def test_weights_first_gives_the_rows_of_x_at_w_transposed_inside_and_outside_its_rows(bias):
    linear = nn.Linear(96, 160, bias=bias)
    if bias:
        linear.bias = mx.random.normal((160,))
    layer = WeightsFirstLinear(linear, (16, 48))
    assert layer.weight is linear.weight
    for shape in [(1, 1, 96), (16, 1, 96), (4, 8, 96), (3, 16, 96), (64, 1, 96)]:
        x = mx.random.normal(shape)
        got, expected = layer(x), linear(x)
        assert got.shape == expected.shape == (*shape[:-1], 160)
        assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item(), shape


def test_the_rows_taken_are_the_first_run_that_measured_faster_by_the_margin():
    weight = mx.zeros((8, 8))
    assert faster_rows(weight, scripted({16: 1.5, 32: 1.3, 48: 1.05})) == (16, 32)
    assert faster_rows(weight, scripted({32: 2.0, 48: 1.2})) == (32, 48)
    assert faster_rows(weight, scripted({16: 1.5, 48: 1.5})) == (16, 16)
    assert faster_rows(weight, scripted({16: 1.09, 32: 1.0, 48: 0.5})) is None


# hidden 512: its MLP's weights (1024 x 512) are large enough to lay out, its attention's not
WIDER = {"hidden": 512}


def test_a_models_float32_linears_are_laid_out_by_shape_and_its_logits_do_not_change(
    demo_model_factory,
):
    model, _ = load(str(demo_model_factory(**WIDER)))
    model.eval()
    tokens = mx.array([[5 + row, 9, 13 + row] for row in range(16)])
    before = model(tokens)
    asked: list[tuple[tuple[int, ...], int]] = []

    def timer(weight, rows):
        asked.append((tuple(weight.shape), rows))
        return (2.0, 1.0) if weight.shape[0] != weight.shape[1] else (1.0, 1.0)

    (laid_out,) = lay_out(model, timer=timer)
    assert laid_out is model
    linears = [layer for _, layer in model.named_modules() if isinstance(layer, nn.Linear)]
    large = [layer for layer in linears if layer.weight.size >= SMALLEST_WEIGHT]
    square = [layer for layer in large if layer.weight.shape[0] == layer.weight.shape[1]]
    if blas.status().name != "mkl":  # nothing to avoid: mlx computes as it does
        assert swapped(model) == 0 and not asked
        return
    # each large shape timed once per row count, whatever the number of layers sharing it
    assert len(asked) == len(set(asked)) == 3 * len({tuple(x.weight.shape) for x in large})
    assert len(large) < len(linears)  # the small ones were never timed
    assert swapped(model) == len(large) - len(square) > 0
    assert not any(isinstance(layer, WeightsFirstLinear) for layer in square)
    assert mx.allclose(model(tokens), before, atol=1e-4, rtol=1e-4).item()


def test_a_linear_alone_is_laid_out_and_the_environment_can_turn_it_off(monkeypatch):
    winning = scripted({16: 2.0, 32: 2.0, 48: 2.0})
    (laid_out,) = lay_out(nn.Linear(512, 1024), timer=winning)
    assert isinstance(laid_out, WeightsFirstLinear) == (blas.status().name == "mkl")
    assert type(lay_out(nn.Linear(32, 64), timer=winning)[0]) is nn.Linear  # too small to matter
    monkeypatch.setenv(LAYOUT_ENV, "off")
    assert type(lay_out(nn.Linear(512, 1024), timer=winning)[0]) is nn.Linear


def test_a_batch_of_sixteen_decodes_the_same_tokens_weights_first(demo_model_factory, monkeypatch):
    """The single engine's decode step over 16 rows, every large float32 layer weights first
    (a scripted clock says it wins), against mlx's own products (the layout turned off)."""
    monkeypatch.setattr(gemm_layout, "time_both", lambda weight, rows: (2.0, 1.0))
    model_dir = demo_model_factory(**WIDER)
    found = {}
    for layout in ("off", "auto"):
        monkeypatch.setenv(LAYOUT_ENV, layout)
        runner = EngineRunner(SingleEngine(model_dir, EngineOptions(max_batch=16)), max_batch=16)
        runner.start(120)
        try:
            if layout == "auto" and blas.status().name == "mkl":
                assert swapped(runner.engine.model) > 0
            requests = [
                make_request(runner.engine, f"Row {row} of the batch, about {row * 3}", 12)
                for row in range(16)
            ]
            found[layout] = [outcome.tokens for outcome in run_all(runner, requests)]
        finally:
            runner.close()
    assert all(len(tokens) == 12 for tokens in found["off"])
    assert found["auto"] == found["off"]
