"""`tandem import FILE [OUT]`: a GGUF file into an mlx-lm model directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from discovery.directories import default_cache_dir

from .options import add_flag


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "import", help="import a GGUF file (llama.cpp, Ollama) as an mlx-lm model directory"
    )
    parser.add_argument(
        "file", type=Path, help="GGUF file, or any part of a split one (NAME-00001-of-0000N.gguf)"
    )
    parser.add_argument(
        "out",
        type=Path,
        nargs="?",
        help="directory to create (default: tandem's cache, where --model FILE finds it)",
    )
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="write float weights instead of quantized ones (4-7x the memory; on the CPU, "
        "tandem's kernel serves the quantized ones faster, unless --cpu-kernels off)",
    )
    add_flag(
        parser,
        "--cache-dir",
        default=default_cache_dir(),
        cast=Path,
        help="where imports live when OUT is not given (under gguf/)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engines.model.gguf.cache import ensure_imported
    from engines.model.gguf.importer import import_gguf

    from .progress import counting

    with counting(f"importing {args.file.name}", "tensors") as advance:
        if args.out is None:
            directory = ensure_imported(
                args.file, args.cache_dir, progress=advance, dequantize=args.dequantize
            )
        else:
            directory = import_gguf(
                args.file.expanduser(), args.out, progress=advance, dequantize=args.dequantize
            )
    print(f"imported {args.file} to {directory}")
    return 0
