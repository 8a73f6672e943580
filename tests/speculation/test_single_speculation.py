"""Prompt-lookup speculation in the single engine: the tokens of decoding one at a time,
several per pass, on every architecture whose caches can be trimmed."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
from mlx_lm import load

from engines.core.engine_options import EngineOptions
from engines.core.request import GenerationRequest
from engines.decoding.decode_batch import DecodeBatch
from engines.decoding.sampling import greedy, make_request_processors, make_request_sampler
from engines.speculation.lane import SpeculationCounts
from engines.speculation.prompt_lookup import PromptLookup
from tests.helpers.scripted_drafter import ScriptedDrafter

PROMPT = "the cat sat on the mat. the cat sat on the"
MOST_DRAFTED = 4


def decode(
    model_dir: Path,
    prompt: str,
    count: int,
    plain: list[int] | None = None,
    make_sampler: Callable = lambda: greedy,
    processors: list | None = None,
    top_logprobs: int | None = None,
) -> tuple[list[int], list[float | None], SpeculationCounts | None]:
    """`count` tokens of one sequence decoded alone: plainly, or given the `plain` tokens,
    speculating with the scripted drafter."""
    model, tokenizer = load(str(model_dir))
    prompt_tokens = tokenizer.encode(prompt)
    script = [*prompt_tokens, *(plain or [])]
    drafter = partial(ScriptedDrafter, script) if plain else PromptLookup
    batch = DecodeBatch(model, 8, 64, most_drafted=MOST_DRAFTED if plain else 0, drafter=drafter)
    batch.insert(0, prompt_tokens, make_sampler(), processors or [], top_logprobs)
    tokens, logprobs = [], []
    while len(tokens) < count:
        for output in batch.step():
            tokens.append(output.token)
            logprobs.append(output.logprob)
    counts = batch.speculation()
    batch.close()
    return tokens[:count], logprobs[:count], counts


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "phi3", "deepseek_v3"])
def test_greedy_tokens_equal_decoding_one_at_a_time(demo_model_factory, arch):
    model_dir = demo_model_factory(arch=arch)
    plain, _, off = decode(model_dir, PROMPT, 48)
    spoken, _, counts = decode(model_dir, PROMPT, 48, plain)
    assert spoken == plain
    assert off is None
    assert counts.accepted > 0 and counts.drafted > counts.accepted  # both paths ran
    assert counts.steps < 40  # fewer passes than tokens


def test_a_sliding_window_is_rolled_back_while_it_holds_every_position(demo_model_factory):
    """gemma3's demo layers alternate a 16-token window with full attention: drafts are
    checked and trimmed inside the window, and once it is full the sequence decodes plainly."""
    model_dir = demo_model_factory(arch="gemma3_text")
    plain, _, _ = decode(model_dir, "the cat", 30)
    spoken, _, counts = decode(model_dir, "the cat", 30, plain)
    assert spoken == plain
    assert counts.accepted > 0 and counts.drafted > counts.accepted


def test_seeded_sampling_draws_the_same_tokens(demo_model_dir):
    """Each position is drawn with the draw it has in plain decoding (its own key), so a seeded
    request's tokens do not depend on speculation: its distribution is the model's."""

    def seeded(seed: int) -> Callable:
        request = GenerationRequest("s", (1,), 48, temperature=0.9, top_p=0.95, seed=seed)
        return lambda: make_request_sampler(request)

    plain, _, _ = decode(demo_model_dir, PROMPT, 48, make_sampler=seeded(7))
    spoken, _, counts = decode(demo_model_dir, PROMPT, 48, plain, seeded(7))
    assert spoken == plain
    assert counts.accepted > 0 and counts.drafted > counts.accepted
    assert decode(demo_model_dir, PROMPT, 48, plain, seeded(8))[0] != plain  # it sampled


def test_penalties_and_logprobs_are_those_of_plain_decoding(demo_model_dir):
    request = GenerationRequest("p", (1,), 40, repetition_penalty=1.3, frequency_penalty=0.2)
    processors = make_request_processors(request)
    plain, plain_logprobs, _ = decode(
        demo_model_dir, PROMPT, 40, processors=processors, top_logprobs=2
    )
    spoken, logprobs, counts = decode(
        demo_model_dir, PROMPT, 40, plain, processors=processors, top_logprobs=2
    )
    assert spoken == plain
    assert logprobs == pytest.approx(plain_logprobs, abs=1e-4)
    assert counts.accepted > 0
    unpenalized = decode(demo_model_dir, PROMPT, 40, top_logprobs=2)[1]
    assert unpenalized != pytest.approx(plain_logprobs, abs=1e-3)  # the penalties did something


def test_prompt_lookup_is_timed_where_the_kernel_makes_a_verifying_pass_costly(
    demo_model_factory,
) -> None:
    from engines.single.engine import SingleEngine
    from engines.speculation.prompt_lookup import TimedPromptLookup

    drafters = {}
    for bits in (None, 4):
        engine = SingleEngine(
            demo_model_factory(quantize=bits), EngineOptions(most_drafted=MOST_DRAFTED)
        )
        engine.load()
        drafters[bits] = engine._batch.lane.drafter
        engine.close()
    assert drafters == {None: PromptLookup, 4: TimedPromptLookup}
    assert TimedPromptLookup.costly and not PromptLookup.costly  # Payoff times the second
