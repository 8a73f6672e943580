"""GGML blocks into mlx: repacked bit for bit, moved exactly, or re-quantized within the error
docs/gguf.md states; a type nothing handles is refused by name."""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from engines.model.gguf.cache import ensure_imported
from engines.model.gguf.native import repack
from errors import ModelError
from tests.helpers.gguf_errors import TYPES, measure
from tests.helpers.gguf_k_quants import quantize_q4_k, quantize_q6_k

T = GGMLQuantizationType
# The most each re-quantized type may leave (relative RMS against the GGUF's own values),
# a margin above what docs/gguf.md's table measured. Every other type must be exact.
REQUANTIZED_BOUNDS = {
    T.Q6_K: 0.01,
    T.Q3_K: 0.09,
    T.Q2_K: 0.06,
    T.IQ4_NL: 0.04,
    T.IQ4_XS: 0.04,
    T.IQ3_S: 0.11,
    T.IQ3_XXS: 0.12,
    T.IQ2_S: 0.22,
    T.IQ2_XS: 0.22,
    T.IQ2_XXS: 0.22,
    T.IQ1_M: 0.18,
    T.IQ1_S: 0.13,
}
EXACT = 1e-6


def test_native_blocks_repack_as_mx_load_reads_them(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "native.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for kind in (T.Q8_0, T.Q4_0, T.Q4_1):
        for shape in ((48, 96), (3, 16, 64)):  # a matrix and a stack of experts
            values = rng.standard_normal(shape).astype(np.float32)
            name = f"{kind.name}_{len(shape)}d.weight"  # mx.load names scales X.scales
            writer.add_tensor(name, quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    loaded = mx.load(str(path))
    reader = gguf.GGUFReader(path)
    assert len(reader.tensors) == 6
    for tensor in reader.tensors:
        packed = repack(np.asarray(tensor.data), tensor.tensor_type)
        assert packed.group_size == 32
        assert packed.bits == (8 if tensor.tensor_type == T.Q8_0 else 4)
        assert np.array_equal(np.array(loaded[tensor.name]), packed.weight)
        module = tensor.name.removesuffix(".weight")
        assert np.array_equal(np.array(loaded[f"{module}.scales"]), packed.scales)
        assert np.array_equal(np.array(loaded[f"{module}.biases"]), packed.biases)


@pytest.mark.parametrize("kind", TYPES, ids=[kind.name for kind in TYPES])
def test_each_type_imports_within_its_stated_error(kind: GGMLQuantizationType) -> None:
    row = measure(kind)
    bound = REQUANTIZED_BOUNDS.get(kind, EXACT)
    assert row.kind == ("requantized" if kind in REQUANTIZED_BOUNDS else row.kind)
    assert row.relative_rms <= bound, f"{kind.name}: {row.relative_rms:.2e} > {bound:.0e}"


@pytest.mark.parametrize(
    ("encode", "kind", "bound"), [(quantize_q4_k, T.Q4_K, 0.09), (quantize_q6_k, T.Q6_K, 0.025)]
)
def test_test_encoders_write_what_gguf_reads(encode, kind: GGMLQuantizationType, bound: float):
    """The round trips' K-type encoders agree with gguf-py's decoders (4 and 6 bits' error)."""
    values = np.random.default_rng(1).standard_normal((4, 512)).astype(np.float32)
    decoded = quants.dequantize(encode(values), kind)
    error = np.sqrt(((decoded - values) ** 2).mean()) / values.std()
    assert error < bound


def test_a_type_nothing_handles_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "q8_1.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("embedding_length", 32), ("block_count", 1), ("context_length", 64)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_uint32("llama.attention.head_count", 2)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    blocks = np.zeros((32, gguf.GGML_QUANT_SIZES[T.Q8_1][1]), dtype=np.uint8)  # 32 rows x 32
    writer.add_tensor("blk.0.ffn_down.weight", blocks, raw_shape=blocks.shape, raw_dtype=T.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache = tmp_path / "cache"
    with pytest.raises(ModelError, match=r"blk\.0\.ffn_down\.weight has type Q8_1"):
        ensure_imported(path, cache)
    assert [p.name for p in (cache / "gguf").iterdir()] == ["digests.json"]
