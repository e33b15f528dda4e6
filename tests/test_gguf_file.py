"""The GGUF parser and dequantization, checked against gguf's reader and transformers' loader."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from vbatch.errors import ModelLoadError
from vbatch.models.gguf_file import GGUFTensor, dequantize, read_gguf
from vbatch.models.loader import ResolvedModel, resolve_model

# NOTE: byte offsets of each K-quant block's float16 scales (ggml's block layouts), so crafted
# random blocks carry small finite scales.
K_QUANT_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16", "F16")


def crafted_blocks(type_name: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random K-quant bytes for a [rows, cols] tensor, with scales between 1e-3 and 1e-2."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (shape[0] * shape[1] // block_size, type_size), dtype=np.uint8)
    for offset in K_QUANT_SCALES[type_name]:
        scales = rng.uniform(1e-3, 1e-2, blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(shape[0], -1)


def quantized(type_name: str, weight: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    import gguf
    from gguf.quants import quantize

    if type_name in K_QUANT_SCALES:
        return crafted_blocks(type_name, weight.shape, rng)
    return quantize(weight, gguf.GGMLQuantizationType[type_name])


def test_reader_matches_gguf_reader(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "values.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 7)
    writer.add_int16("t.i16", -300)
    writer.add_uint64("t.u64", 1 << 40)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.flag", True)
    writer.add_string("t.text", "héllo")
    writer.add_array("t.strings", ["a", "", "ü b"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    q8 = quantized("Q8_0", rng.standard_normal((2, 64)).astype(np.float32), rng)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = read_gguf(path)
    reference = gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == expected
    assert [t.name for t in ours.tensors] == ["f32", "f16", "q8"]
    for got, want in zip(ours.tensors, reference.tensors, strict=True):
        assert got.shape == tuple(reversed(want.shape.tolist()))
        assert got.tensor_type == want.tensor_type
        np.testing.assert_array_equal(
            dequantize(got), gguf.quants.dequantize(want.data, want.tensor_type).reshape(got.shape)
        )


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_numpy_dequantize_is_bit_identical_to_gguf(type_name: str) -> None:
    import gguf

    rng = np.random.default_rng(1)
    weight = (rng.standard_normal((5, 96)) * 3).astype(np.float32)
    data = quantized(type_name, weight, rng)
    qtype = gguf.GGMLQuantizationType[type_name]
    got = dequantize(GGUFTensor("w", weight.shape, qtype, data))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, gguf.quants.dequantize(data, qtype))
    assert np.abs(got - weight).max() < np.abs(weight).max() / 7


def test_a_tensor_without_dimensions_is_a_load_error(tmp_path: Path) -> None:
    """It was an IndexError, reported as a bug in vbatch."""

    def text(value: str) -> bytes:
        return struct.pack("<Q", len(value)) + value.encode()

    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 1)
    metadata = text("general.architecture") + struct.pack("<I", 8) + text("llama")
    tensor = text("token_embd.weight") + struct.pack("<IIQ", 0, 0, 0)
    path = tmp_path / "zero_dims.gguf"
    path.write_bytes((header + metadata + tensor).ljust(256, b"\0"))
    with pytest.raises(ModelLoadError, match=r"token_embd\.weight has no dimensions"):
        read_gguf(path)


def test_file_cut_inside_a_tensor(tmp_path: Path, smollm2: ResolvedModel) -> None:
    cut = tmp_path / "cut.gguf"
    data = Path(smollm2.source).read_bytes()
    cut.write_bytes(data[: len(data) - 4096])
    with pytest.raises(ModelLoadError, match=f"cannot read GGUF file {cut}.*past the end"):
        read_gguf(cut)


def test_every_quant_type_loads_as_transformers_loads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A llama GGUF whose matrices use every type gguf quantizes plus crafted K-quant blocks,
    converted by vbatch and by transformers' own GGUF loader (an independent dequantizer)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("VBATCH_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "mixed.gguf"
    types = [*QUANTIZABLE, *K_QUANT_SCALES]
    write_mixed_gguf(path, types)
    converted = load_file(resolve_model(path).hf_dir / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).state_dict()
    reference.pop("lm_head.weight")
    assert converted.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(converted[name], tensor, rtol=1e-6, atol=1e-6, msg=name)


def write_mixed_gguf(path: Path, types: list[str]) -> None:
    """Tiny llama (hidden 256 so K-quant rows fit) with the i-th matrix stored as types[i % n],
    and a byte-level vocabulary of the 256 bytes and one merge."""
    import gguf

    from vbatch.models.gguf_tokenizer import byte_alphabet

    hidden, ffn, heads, kv_heads, layers = 256, 512, 4, 2, 2
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", layers)
    writer.add_uint32("llama.context_length", 256)
    writer.add_uint32("llama.embedding_length", hidden)
    writer.add_uint32("llama.feed_forward_length", ffn)
    writer.add_uint32("llama.attention.head_count", heads)
    writer.add_uint32("llama.attention.head_count_kv", kv_heads)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_tokenizer_model("gpt2")
    tokens = [*byte_alphabet().values(), "\u0120t"]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(["\u0120 t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    rng = np.random.default_rng(2)
    writer.add_tensor(
        "token_embd.weight", rng.standard_normal((len(tokens), hidden)).astype(np.float16)
    )
    writer.add_tensor("output_norm.weight", rng.standard_normal(hidden).astype(np.float32))
    shapes = {
        "attn_q": (hidden, hidden),
        "attn_k": (hidden // heads * kv_heads, hidden),
        "attn_v": (hidden // heads * kv_heads, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }
    index = 0
    for layer in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            weight = rng.standard_normal(hidden).astype(np.float32)
            writer.add_tensor(f"blk.{layer}.{norm}.weight", weight)
        for part, shape in shapes.items():
            type_name = types[index % len(types)]
            index += 1
            weight = rng.standard_normal(shape).astype(np.float32)
            data = quantized(type_name, weight, rng)
            qtype = gguf.GGMLQuantizationType[type_name]
            writer.add_tensor(f"blk.{layer}.{part}.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
