"""An imported GGUF is a model like any other: the single engine, the pipeline's stages and a
2-rank tensor-parallel ring decode the same tokens from a Q4_K_M-like import (4-bit layers
with 8-bit embeddings, v and down projections: per-layer quantization in its config)."""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType

from engines.model.gguf.importer import import_gguf
from engines.model.info import inspect_model
from tests.helpers.architectures import run_single, run_stage_chain, run_tp
from tests.helpers.demo_models import make_demo_model
from tests.helpers.gguf_export import Q4_K_M, export_gguf

SPEC = {"arch": "llama", "layers": 2, "heads": 4, "kv_heads": 2, "hidden": 256}


def test_single_pp_and_tp_engines_serve_an_import_alike(gguf_root: Path, tmp_path: Path) -> None:
    folder = tmp_path
    demo = make_demo_model(gguf_root / "demo", **SPEC)
    export_gguf(demo, folder / "mixed.gguf", GGMLQuantizationType.Q4_K, mixture=Q4_K_M)
    path = import_gguf(folder / "mixed.gguf", folder / "imported")
    facts = inspect_model(path)
    assert facts.quantized
    single = run_single(path)
    assert single.error is None and single.tokens
    stages = run_stage_chain(path, facts)
    assert (stages.error, stages.refusal, stages.tokens) == (None, None, single.tokens)
    ranks = run_tp(path, facts)
    assert (ranks.error, ranks.refusal, ranks.tokens) == (None, None, single.tokens)
