"""A test server: the API app with the demo tokenizer and no engine, on 127.0.0.1.

Usage: python -m tests.serve_api_only MODEL_DIR PORT MAX_BODY_BYTES
Every limit is checked before a request would reach an engine, so none is needed here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import uvicorn
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engines.api import create_app
from engines.service import Service


def main() -> None:
    model_dir, port, max_body_bytes = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    service = Service(model_id="tandem-demo", tokenizer=load_tokenizer(model_dir), state="ok")
    app = create_app(service, max_prompt_tokens=4096, max_body_bytes=max_body_bytes)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
