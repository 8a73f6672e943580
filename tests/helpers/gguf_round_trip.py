"""A demo model through GGUF and back: export as llama.cpp would, import with tandem, and the
greedy tokens of the import beside those of a reference holding the GGUF's own values."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from gguf import GGMLQuantizationType
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model
from tokenizers import Tokenizer

from engines.model.gguf.importer import import_gguf
from tests.helpers.demo_models import make_demo_model
from tests.helpers.gguf_export import export_gguf

PROMPTS = (
    "Once upon a time",
    # Longer than the demo's 16-token sliding window, so windowed layers drop old positions.
    "In the beginning the model read a long prompt, sentence after sentence, and then it",
)
MAX_TOKENS = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True, slots=True)
class RoundTrip:
    """What one export and import did: both models' greedy tokens and teacher-forced picks."""

    imported: Path
    reference_tokens: tuple[tuple[int, ...], ...]
    imported_tokens: tuple[tuple[int, ...], ...]
    agreement: float  # share of positions where both pick the same next token (same inputs)
    logit_error: float  # rms(imported - reference logits) / rms(reference logits), same inputs


def round_trip(
    root: Path,
    arch: str,
    quantization: GGMLQuantizationType,
    config: dict | None = None,
    mixture: dict[str, GGMLQuantizationType] | None = None,
    **spec: int,
) -> RoundTrip:
    """Export the demo model `arch` (tiny, float; `config` entries changed) as GGUF with
    `quantization` (`mixture`: per-tensor exceptions, see export_gguf), import it."""
    name = f"{arch}-{quantization.name}-" + "-".join(f"{k}{v}" for k, v in sorted(spec.items()))
    name += ("-changed" if config else "") + ("-mixed" if mixture else "")
    work = root / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    demo = make_demo_model(root / "demo", arch=arch, **spec)
    if config:
        demo = shutil.copytree(demo, work / "original")
        document = imported_config(demo)
        (demo / "config.json").write_text(json.dumps({**document, **config}))
    held = export_gguf(demo, work / "model.gguf", quantization, mixture=mixture)
    reference = work / "reference"
    reference.mkdir()
    shutil.copy(demo / "config.json", reference / "config.json")
    mx.save_safetensors(
        str(reference / "model.safetensors"), {k: mx.array(v) for k, v in held.items()}
    )
    imported = import_gguf(work / "model.gguf", work / "imported")
    tokenizer = Tokenizer.from_file(str(demo / "tokenizer.json"))
    prompts = [tokenizer.encode(prompt).ids for prompt in PROMPTS]
    reference_model = load_model(reference)[0]
    imported_model = load_model(imported)[0]
    reference_tokens = tuple(greedy(reference_model, ids) for ids in prompts)
    imported_tokens = tuple(greedy(imported_model, ids) for ids in prompts)
    sequences = [p + list(t) for p, t in zip(prompts, reference_tokens, strict=True)]
    agreement, logit_error = teacher_forced(reference_model, imported_model, sequences)
    return RoundTrip(imported, reference_tokens, imported_tokens, agreement, logit_error)


def greedy(model, ids: list[int]) -> tuple[int, ...]:
    steps = generate_step(mx.array(ids), model, max_tokens=MAX_TOKENS)
    return tuple(int(token) for token, _ in steps)


def teacher_forced(first, second, sequences: list[list[int]]) -> tuple[float, float]:
    """Fed the same tokens: the share of positions where both models' argmax agree, and the
    rms of their logits' difference relative to the rms of the first's (centred) logits."""
    same = total = 0
    squared_error = squared_scale = 0.0
    for ids in sequences:
        batch = mx.array(ids)[None]
        logits = [model(batch)[0].astype(mx.float32) for model in (first, second)]
        picks = [mx.argmax(value, axis=-1).tolist() for value in logits]
        same += sum(a == b for a, b in zip(*picks, strict=True))
        total += len(ids)
        centred = logits[0] - logits[0].mean(axis=-1, keepdims=True)
        squared_error += float(((logits[1] - logits[0]) ** 2).sum())
        squared_scale += float((centred**2).sum())
    return same / total, (squared_error / squared_scale) ** 0.5


def imported_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())
