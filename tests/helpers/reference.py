"""What the single engine says: the reference every cluster test compares its answers with."""

from __future__ import annotations

import asyncio
from pathlib import Path

from openai import OpenAI

from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner
from engines.single.engine import SingleEngine
from tests.helpers.serve import ServeProcess

PROMPTS = ([5, 60, 61, 62, 63], [7, 100, 200, 300, 41, 42, 43, 44], [9, 500, 17])
MAX_TOKENS = 48


def single_outputs(model: Path) -> list[str]:
    """What SingleEngine says for PROMPTS, through the same runner and detokenizer as serve."""
    engine = SingleEngine(model)
    runner = EngineRunner(engine)
    runner.start()

    async def generate(prompt: list[int]) -> str:
        submission = runner.submit(GenerationRequest("ref", tuple(prompt), MAX_TOKENS))
        return "".join([event.text async for event in submission.events()])

    try:
        return [asyncio.run(generate(prompt)) for prompt in PROMPTS]
    finally:
        runner.close()


def completions(server: ServeProcess, model_id: str) -> list[str]:
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60)
    texts = []
    for prompt in PROMPTS:
        reply = client.completions.create(
            model=model_id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        texts.append(reply.choices[0].text)
    return texts
