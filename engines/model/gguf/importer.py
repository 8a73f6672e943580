"""A GGUF file -> an mlx-lm model directory, built in a hidden directory and renamed whole."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from gguf import GGMLQuantizationType

from engines.model.gguf.architectures import CONFIG_TENSORS, find_architecture
from engines.model.gguf.configs import build_config
from engines.model.gguf.quantization import FLOAT_TYPES, Treatment, scales_dtype
from engines.model.gguf.source import GGUFSource, open_source
from engines.model.gguf.tensors import TensorPlan, convert, plan_tensor
from engines.model.gguf.writer import ShardWriter, write_json
from engines.model.precision import on_cpu
from errors import ModelError

log = logging.getLogger(__name__)

# Room kept free beyond the model's own bytes, so an import never fills a disk to the brim.
DISK_MARGIN_BYTES = 512 * 1024**2
GGUF_SOURCE_FILE = "gguf_source.json"  # which file the directory was imported from
EMBEDDING_TENSOR = "token_embd.weight"

Progress = Callable[[int, int], None]  # (tensors done, tensors in all)
FLOAT = Treatment("float")
FLOAT_NAMES = frozenset(kind.name for kind in FLOAT_TYPES)


def import_gguf(
    path: Path, out_dir: Path, progress: Progress | None = None, dequantize: bool = False
) -> Path:
    """Import the GGUF at `path` into `out_dir` (absent or empty) atomically; returns out_dir.

    `dequantize` writes every tensor as float (float32 on the CPU, where mlx's own quantized
    matmul, without tandem's kernel, prefills ~10x slower than through float; float16
    elsewhere).

    Everything is written into a hidden directory beside `out_dir` and renamed at the end, so
    a failure (bad input, full disk, interruption) leaves nothing that looks like a model.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ModelError(f"{out_dir} already exists and is not an empty directory")
    source = open_source(Path(path))
    plans, config = plan_import(source, dequantize)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    check_disk_room(out_dir.parent, estimate_bytes(plans, config["torch_dtype"]))
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.partial-"))
    try:
        write_model(source, plans, config, staging, progress)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def plan_import(source: GGUFSource, dequantize: bool = False) -> tuple[list[TensorPlan], dict]:
    """Every tensor's plan and the config.json, checked before a byte is written."""
    architecture = find_architecture(source.architecture)
    config = build_config(source, architecture)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    plans = [
        plan_tensor(tensor, architecture, heads, kv_heads)
        for name, tensor in source.tensors.items()
        if name not in CONFIG_TENSORS
    ]
    if dequantize:
        plans = [dataclasses.replace(plan, treatment=FLOAT) for plan in plans]
    config["torch_dtype"] = float_dtype(source, plans)
    # Not the embedding's: a lookup's rows come out in its scales' dtype, and the whole
    # residual stream would follow them into float16.
    half_scales = kernel_reads_half_scales()
    plans = [
        dataclasses.replace(
            plan,
            scales_dtype=scales_dtype(
                GGMLQuantizationType(plan.tensor.tensor_type),
                plan.treatment,
                config["torch_dtype"],
                half_scales and plan.tensor.name != EMBEDDING_TENSOR,
            ),
        )
        for plan in plans
    ]
    quantization = quantization_entries(plans)
    if quantization:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    return plans, config


def float_dtype(source: GGUFSource, plans: list[TensorPlan]) -> str:
    """The float type of the imported model (its scales, biases and float tensors).

    On the CPU a quantized GGUF computes in float32: mlx's CPU kernels take float16 scales
    ~40x slower (fp16 -> fp32 is exact, so the GGUF's values are kept). Elsewhere: the
    embedding's type when it is float, else float16, the type of the GGUF's own block scales.
    """
    if on_cpu() and any(plan.tensor.tensor_type.name not in FLOAT_NAMES for plan in plans):
        return "float32"
    embedding = source.tensors[EMBEDDING_TENSOR].tensor_type.name
    return {"F32": "float32", "BF16": "bfloat16"}.get(embedding, "float16")


def quantization_entries(plans: list[TensorPlan]) -> dict:
    """config.json's quantization: the commonest setting, and each layer that differs."""
    settings = {plan.module: plan.treatment.quantization() for plan in plans}
    quantized = {module: setting for module, setting in settings.items() if setting}
    if not quantized:
        return {}
    counts = Counter(tuple(sorted(setting.items())) for setting in quantized.values())
    default = dict(counts.most_common(1)[0][0])
    entries: dict = dict(default)
    for module, setting in sorted(quantized.items()):
        if setting != default:
            entries[module] = setting
    return entries


def kernel_reads_half_scales() -> bool:
    """On the CPU, whether tandem's kernel computes the quantized layers (mlx's own CPU
    quantized matmul takes float16 scales ~40x slower than float32 ones)."""
    from engines import kernels

    return on_cpu() and kernels.load() is not None


def estimate_bytes(plans: list[TensorPlan], dtype: str) -> int:
    return sum(
        plan.treatment.output_bytes(plan.tensor.n_elements, dtype, plan.scales_dtype)
        for plan in plans
    )


def check_disk_room(directory: Path, needed: int) -> None:
    """A ModelError before writing when the disk under `directory` cannot hold `needed`."""
    free = shutil.disk_usage(directory).free
    if free < needed + DISK_MARGIN_BYTES:
        raise ModelError(
            f"not enough disk space in {directory} to import the model: it needs about "
            f"{_gib(needed)} plus {_gib(DISK_MARGIN_BYTES)} spare, {_gib(free)} is free"
        )


def write_model(
    source: GGUFSource,
    plans: list[TensorPlan],
    config: dict,
    directory: Path,
    progress: Progress | None = None,
) -> None:
    """Weights, config.json and tokenizer files of the model into `directory`."""
    from engines.model.gguf.tokenizer import write_tokenizer

    started = time.perf_counter()
    writer = ShardWriter(directory)
    for done, plan in enumerate(plans, start=1):
        writer.add(convert(plan, config["torch_dtype"]))
        if progress is not None:
            progress(done, len(plans))
    writer.finish()
    write_json(directory / "config.json", config)
    write_tokenizer(source.metadata, directory)
    write_json(
        directory / GGUF_SOURCE_FILE,
        {"files": [path.name for path in source.paths], "architecture": source.architecture},
    )
    log.info(
        "imported %s (%s, %d tensors) in %.1f s",
        source.paths[0].name,
        source.architecture,
        len(plans),
        time.perf_counter() - started,
    )


def _gib(count: int) -> str:
    return f"{count / 1024**3:.1f} GiB"
