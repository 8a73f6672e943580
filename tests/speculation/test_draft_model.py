"""Draft-model drafting (--draft-model): another model with the same tokenizer guesses, the
served model checks, and the tokens are those of plain decoding; a draft model that does not
share the tokenizer is refused with the reason; steps that did not draft reach the draft model
with its next draft."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load

from engines.core.engine_options import EngineOptions
from engines.core.runner import EngineRunner
from engines.single.engine import SingleEngine
from engines.speculation.draft_model import DraftModelDrafter
from errors import EngineError
from tests.helpers.engine import make_request, run_one

PROMPTS = ("The quick brown fox", "Once upon a time, in a city by the sea,")
TOKENS = 40


def start(model_dir: Path, **options) -> EngineRunner:
    runner = EngineRunner(
        SingleEngine(model_dir, EngineOptions(**options)), queue_size=4, max_batch=4
    )
    runner.start(120)
    return runner


@pytest.fixture(scope="module")
def plain(demo_model_dir: Path) -> Iterator[EngineRunner]:
    runner = start(demo_model_dir)
    yield runner
    runner.close()


@pytest.mark.parametrize("draft", ["itself", "another"])
def test_greedy_tokens_equal_plain_decoding(plain, demo_model_dir, demo_model_factory, draft):
    """Drafting from the served model itself accepts every draft; from another model (the
    same tokenizer, other weights) most are rejected: either way the tokens are the same."""
    draft_dir = demo_model_dir if draft == "itself" else demo_model_factory(seed=1)
    runner = start(demo_model_dir, most_drafted=4, draft_model_path=str(draft_dir))
    try:
        for prompt in PROMPTS:
            expected = run_one(plain, make_request(plain.engine, prompt, TOKENS))
            got = run_one(runner, make_request(runner.engine, prompt, TOKENS))
            assert got.tokens == expected.tokens, prompt
        counts = runner.engine.info().detail["speculation"]
    finally:
        runner.close()
    assert counts["drafter"] == str(draft_dir)
    if draft == "itself":  # right but for near ties (a draft model fed several tokens at once
        # computes them apart from the target's one by one)
        assert counts["drafted"] > 0 and counts["accepted"] >= 0.75 * counts["drafted"]
    else:
        assert counts["drafted"] > counts["accepted"]


def test_a_draft_model_with_another_tokenizer_is_refused(demo_model_dir, demo_model_factory):
    engine = SingleEngine(
        demo_model_dir,
        EngineOptions(most_drafted=4, draft_model_path=str(demo_model_factory(vocab=512))),
    )
    with pytest.raises(EngineError, match="the draft model's tokenizer is not the target's"):
        engine.load()
    engine.close()


def test_steps_that_did_not_draft_are_fed_to_the_draft_model_with_its_next_draft(
    demo_model_dir,
):
    """While drafting pauses (Payoff), the tokens decoded reach the drafter by `extend` alone:
    its next draft feeds them all, and guesses as plain greedy decoding does."""
    model, tokenizer = load(str(demo_model_dir))
    stream = mx.default_stream(mx.default_device())
    prompt = tokenizer.encode(PROMPTS[0])
    plain = DraftModelDrafter(model, stream, prompt).draft(6).tolist()
    drafter = DraftModelDrafter(model, stream, prompt)
    assert drafter.draft(1).tolist() == plain[:1]
    drafter.extend(plain[:2])  # accepted, and the model's own token after it
    drafter.extend(plain[2:3])  # two steps that did not draft
    drafter.extend(plain[3:4])
    assert drafter.draft(2).tolist() == plain[4:6]
    assert drafter.caches[0].offset == len(prompt) + 4 + 1  # the known tokens, one guess
