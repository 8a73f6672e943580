"""`tandem demo-model PATH`: write a small deterministic random-weight model."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo-model", help="write a small random-weight model with a real tokenizer"
    )
    parser.add_argument("path", type=Path, help="directory to create")
    parser.add_argument("--arch", choices=["llama", "qwen3"], default="llama")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int, help="attention heads")
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--hidden", type=int, help="hidden size")
    parser.add_argument("--seed", type=int)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engines.demo_model import DEMO_BUILD_STEPS, DemoSpec, write_demo_model

    from .progress import steps

    overrides = {
        "arch": args.arch,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "hidden": args.hidden,
        "seed": args.seed,
    }
    spec = DemoSpec(**{k: v for k, v in overrides.items() if v is not None})
    with steps("demo model", DEMO_BUILD_STEPS) as advance:
        path = write_demo_model(args.path, spec, progress=advance)
    print(f"wrote {spec.arch} demo model to {path}")
    return 0
