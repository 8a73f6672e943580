"""`tandem demo-model PATH`: write a small deterministic random-weight model."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo-model", help="write a small random-weight model with a real tokenizer"
    )
    parser.add_argument("path", type=Path, help="directory to create")
    parser.add_argument(
        "--arch",
        default="llama",
        help="mlx-lm model type: llama, mistral, qwen2, qwen3, qwen3_moe, gemma3_text, phi3, "
        "gpt_oss or deepseek_v3 (checked against engines/model/demo_spec.py's list)",
    )
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int, help="attention heads")
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--hidden", type=int, help="hidden size")
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--quantize",
        type=int,
        choices=[4, 8],
        help="bits per weight, quantized with mlx-lm's converter (default: float)",
    )
    parser.add_argument(
        "--thinking",
        action="store_true",
        help="add <think> markers and a chat template that thinks unless enable_thinking is "
        "false (as Qwen3's); the model never ends a thought by itself",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engines.model.demo import DEMO_BUILD_STEPS, write_demo_model
    from engines.model.demo_spec import DemoSpec

    from .progress import steps

    overrides = {
        "arch": args.arch,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "hidden": args.hidden,
        "seed": args.seed,
        "quantize": args.quantize,
        "thinking": args.thinking or None,
    }
    spec = DemoSpec(**{k: v for k, v in overrides.items() if v is not None})
    with steps("demo model", DEMO_BUILD_STEPS) as advance:
        path = write_demo_model(args.path, spec, progress=advance)
    quantized = f" ({spec.quantize}-bit)" if spec.quantize else ""
    thinking = " thinking" if spec.thinking else ""
    print(f"wrote {spec.arch}{quantized}{thinking} demo model to {path}")
    return 0
