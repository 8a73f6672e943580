"""A test server: the API app on the demo model, on 127.0.0.1.

Usage:
  python -m tests.helpers.serve_api_only MODEL_DIR PORT MAX_BODY_BYTES [MAX_PROMPT_TOKENS]
    [--engine]
Without --engine only the tokenizer loads: every limit is checked before a request would
reach an engine, so none is needed to test them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import uvicorn

from engines.api import create_app  # first: engines loads the fast BLAS before mlx
from engines.core.runner import EngineRunner
from engines.core.service import Service, ServiceLimits
from engines.single.engine import SingleEngine


def main() -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer  # after engines: fast BLAS first

    model_dir, port, max_body_bytes = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    numbers = [int(argument) for argument in sys.argv[4:] if argument.isdigit()]
    max_prompt_tokens = numbers[0] if numbers else 4096
    runner = None
    if "--engine" in sys.argv[4:]:
        runner = EngineRunner(SingleEngine(model_dir), queue_size=64, max_batch=16)
        runner.start(load_timeout_s=120)
    service = Service(
        model_id="tandem-demo",
        tokenizer=runner.engine.tokenizer if runner else load_tokenizer(model_dir),
        limits=ServiceLimits(max_tokens_cap=64, default_max_tokens=8, request_timeout_s=30),
        runner=runner,
        state="ok",
    )
    app = create_app(service, max_prompt_tokens=max_prompt_tokens, max_body_bytes=max_body_bytes)
    try:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
    finally:
        if runner is not None:
            runner.close()


if __name__ == "__main__":
    main()
