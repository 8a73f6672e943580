"""Layers loaded: the single engine reports them, and the engine-start bar counts them."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli import progress
from engines.observability.load_progress import listening, report
from engines.single.engine import SingleEngine
from tests.helpers.engine import make_request, run_one


def test_the_single_engine_reports_every_layer_as_it_loads(demo_model_dir: Path) -> None:
    seen: list[tuple[int, int]] = []
    engine = SingleEngine(demo_model_dir)
    with listening(lambda done, total: seen.append((done, total))):
        engine.load()
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]  # the demo model has 4 layers
    report(1, 4)  # nobody listens any more
    assert len(seen) == 4
    engine.close()


def test_a_lazily_loaded_engine_still_generates(demo_model_dir: Path) -> None:
    from engines.core.runner import EngineRunner

    runner = EngineRunner(SingleEngine(demo_model_dir))
    runner.start(60)
    try:
        outcome = run_one(runner, make_request(runner.engine, "Once upon a time", 6))
    finally:
        runner.close()
    assert outcome.finish == "length" and len(outcome.tokens) == 6


def test_the_engine_start_bar_counts_layers_only_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with progress.loading("starting the engine"):
        report(2, 4)
    assert capsys.readouterr().err == ""  # stderr is not a terminal under pytest
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    with progress.loading("starting the engine"):
        for done in range(1, 5):
            report(done, 4)
    drawn = capsys.readouterr().err
    assert "starting the engine" in drawn and "4/4 layers" in drawn
