"""Model resolution and GGUF conversion, checked against transformers' own GGUF loader."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vbatch.errors import ModelLoadError
from vbatch.job.manifest import model_identity
from vbatch.layers.attention import TorchAttentionBackend
from vbatch.models.config import ModelConfig
from vbatch.models.gguf import unpermute_qk
from vbatch.models.llama import load_model
from vbatch.models.loader import (
    CONVERSION_RECORD,
    CONVERSION_VERSION,
    DEFAULT_GGUF_NAME,
    ResolvedModel,
    cache_dir,
    default_model_path,
    hash_files,
    resolve_model,
    weight_files,
)

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
)


def test_a_file_replaced_by_one_of_the_same_size_and_mtime_is_hashed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cp -p`, `rsync -a` or a `mv` over the model keep size and mtime: the memo gave the old
    file's hash, so a job ran the old conversion and recorded the old weights_hash."""
    monkeypatch.setenv("VBATCH_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"a" * 64)
    first = hash_files([model])
    replacement = tmp_path / "new.gguf"
    replacement.write_bytes(b"b" * 64)
    mtime_ns = model.stat().st_mtime_ns
    os.utime(replacement, ns=(mtime_ns, mtime_ns))
    replacement.replace(model)
    assert model.stat().st_size == 64 and model.stat().st_mtime_ns == mtime_ns
    assert hash_files([model]) == hashlib.sha256(b"b" * 64).hexdigest() != first
    assert hash_files([model]) == hash_files([model])


def test_default_model_path_is_found() -> None:
    path = default_model_path()
    assert path.name == DEFAULT_GGUF_NAME
    assert path.is_file()


def test_resolve_default_converts_once(smollm2: ResolvedModel) -> None:
    assert smollm2.is_gguf
    assert Path(smollm2.source) == default_model_path()
    assert smollm2.hf_dir.is_relative_to(cache_dir())
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (smollm2.hf_dir / name).is_file(), name
    assert len(smollm2.weights_hash) == 64
    start = time.perf_counter()
    again = resolve_model(smollm2.source)
    assert time.perf_counter() - start < 2.0
    assert again == smollm2
    config = json.loads((smollm2.hf_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True


def test_converted_tokenizer_keeps_chat_template(smollm2: ResolvedModel) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2.hf_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    generation = json.loads((smollm2.hf_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    num_heads, head_dim, hidden = 3, 8, 5
    weight = np.arange(num_heads * head_dim * hidden, dtype=np.float32).reshape(-1, hidden)
    # llama.cpp's converter: [heads, 2, half, in] → [heads, half, 2, in]
    permuted = (
        weight.reshape(num_heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(weight.shape)
    )
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_qk(permuted, num_heads), weight)


def prefill_logits(
    model: torch.nn.Module, ids: torch.Tensor, make_attention_metadata: Callable
) -> torch.Tensor:
    """`model`'s logits for one prompt of token `ids`, prefilled at once into a fresh paged
    cache whose blocks are in reverse order."""
    config = model.config
    block_size = 16
    num_blocks = -(-len(ids) // block_size)
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    table = list(reversed(range(num_blocks)))
    meta = make_attention_metadata([len(ids)], [len(ids)], [table], block_size)
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), kv_caches=kv_caches, meta=meta)
        return model.compute_logits(hidden)


def test_prefill_logits_match_transformers_gguf(
    smollm2: ResolvedModel, make_attention_metadata: Callable
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    gguf_path = Path(smollm2.source)
    tokenizer = AutoTokenizer.from_pretrained(smollm2.hf_dir)
    reference = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    model = load_model(smollm2, torch.device("cpu"), torch.float32, TorchAttentionBackend())
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        logits = prefill_logits(model, torch.tensor(ids), make_attention_metadata)
        with torch.inference_mode():
            expected = reference(torch.tensor([ids])).logits[0]
        assert logits.dtype == torch.float32
        assert (logits - expected).abs().max().item() < 1e-3, prompt
        assert logits[-1].argmax() == expected[-1].argmax()


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match=str(missing)):
        resolve_model(missing)


def test_truncated_gguf(
    tmp_path: Path, smollm2: ResolvedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2.source, "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    # NOTE: a cache of its own: another test's conversion may be under way in the shared one.
    monkeypatch.setenv("VBATCH_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match=str(truncated)):
        resolve_model(truncated)
    assert not list((cache_dir() / "gguf").glob(".converting-*"))


def test_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=f"{tmp_path}.*config.json"):
        resolve_model(tmp_path)


def test_a_dir_of_gguf_files_is_told_to_pass_one_by_the_job_and_the_api(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    hint = (
        "has no config.json but GGUF files: pass one of them, for example "
        f"--model {tmp_path}/model.gguf"
    )
    with pytest.raises(ModelLoadError, match=hint):
        resolve_model(tmp_path)
    with pytest.raises(ModelLoadError, match=hint):
        model_identity(str(tmp_path))


def test_a_damaged_cached_conversion_is_converted_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A truncated weights file, a lost tokenizer or an edited config in the conversion cache
    once failed every later run of that GGUF file; each is now found at the next start."""
    monkeypatch.setenv("VBATCH_CACHE_DIR", str(tmp_path / "cache"))
    first = resolve_model(None)
    record = json.loads((first.hf_dir / CONVERSION_RECORD).read_text())
    assert set(record) >= {"config.json", "model.safetensors", "tokenizer.json"}
    intact = {name: (first.hf_dir / name).read_bytes() for name in record}

    def truncate(path: Path) -> None:
        path.write_bytes(path.read_bytes()[:1000])

    def garble(path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[:-2] + b"0}")

    damages: list[tuple[str, Callable[[Path], None]]] = [
        ("model.safetensors", truncate),
        ("tokenizer.json", Path.unlink),
        ("config.json", garble),
        (CONVERSION_RECORD, Path.unlink),
    ]
    for name, damage in damages:
        damage(first.hf_dir / name)
        caplog.clear()
        with caplog.at_level("WARNING", logger="vbatch.models.loader"):
            again = resolve_model(None)
        assert again == first
        assert "is damaged; converting afresh" in caplog.text, name
        assert {n: (again.hf_dir / n).read_bytes() for n in record} == intact, name
    caplog.clear()
    with caplog.at_level("WARNING", logger="vbatch.models.loader"):
        assert resolve_model(None) == first
    assert not caplog.text
    assert sorted(p.name for p in first.hf_dir.parent.iterdir()) == [first.hf_dir.name]


def test_a_cache_dir_that_is_a_file_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "cache"
    blocker.write_text("not a directory")
    monkeypatch.setenv("VBATCH_CACHE_DIR", str(blocker))
    with pytest.raises(ModelLoadError, match=f"under {blocker}/gguf .*set VBATCH_CACHE_DIR"):
        resolve_model(None)


def test_dir_without_weights(tmp_path: Path, smollm2: ResolvedModel) -> None:
    shutil.copy(smollm2.hf_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="safetensors"):
        resolve_model(tmp_path)


def test_unsupported_architecture(tmp_path: Path, tiny_model_dir: Path) -> None:
    model_dir = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"{model_dir}.*GPT2LMHeadModel.*LlamaForCausalLM"):
        resolve_model(model_dir)
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        load_model(model_dir, torch.device("cpu"), torch.float32, TorchAttentionBackend())


@pytest.mark.parametrize(
    ("file", "key", "value", "message"),
    [
        ("config.json", "rope_theta", 0, "rope_theta must be a positive number, got 0"),
        ("config.json", "rope_theta", -1e4, "rope_theta must be a positive number"),
        ("config.json", "rms_norm_eps", -1, "rms_norm_eps must be zero or positive, got -1"),
        ("config.json", "max_position_embeddings", 0, "max_position_embeddings must be positive"),
        ("config.json", "vocab_size", 0, "vocab_size must be positive, got 0"),
        (
            "generation_config.json",
            "eos_token_id",
            [2, "x"],
            "generation_config.json: eos_token_id [2, 'x'] is not a token id",
        ),
    ],
)
def test_config_values_out_of_range_are_refused_by_name(
    tmp_path: Path, tiny_model_dir: Path, file: str, key: str, value: Any, message: str
) -> None:
    """A rope base or norm epsilon out of range loaded, and every output was NaN: empty texts,
    null embeddings, no error; a bad EOS id in generation_config.json was blamed on
    config.json."""
    model_dir = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, model_dir)
    path = model_dir / file
    config = json.loads(path.read_text()) if path.exists() else {}
    if key == "rope_theta":
        config.pop("rope_parameters", None)
    config[key] = value
    path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        resolve_model(model_dir)


def test_a_shard_index_naming_files_outside_the_directory_is_refused(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """It loaded weights from `../x.safetensors`; a value that is no name said the index named
    no files."""
    model_dir = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir, model_dir)
    shutil.copy(model_dir / "model.safetensors", tmp_path / "outside.safetensors")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    index = model_dir / "model.safetensors.index.json"
    for shard in ("../outside.safetensors", str(tmp_path / "outside.safetensors"), 5, "."):
        index.write_text(json.dumps({"weight_map": dict.fromkeys(names, shard)}))
        with pytest.raises(ModelLoadError, match="values are file names in the model's"):
            resolve_model(model_dir)


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8", None])
def test_a_pre_quantized_checkpoint_is_refused_by_name(
    tmp_path: Path, tiny_model_dir: Path, method: str | None
) -> None:
    """Its weights would have been read as unknown tensors (`...q_proj.qweight`), or, where
    the names match, as plain floats."""
    model_dir = tmp_path / "quantized"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"bits": 4} if method is None else {"quant_method": method}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"{model_dir} is a pre-quantized checkpoint") as e:
        resolve_model(model_dir)
    assert f"quant_method {method!r}" in str(e.value)
    assert "unquantized checkpoint" in str(e.value)


def test_a_config_with_more_kv_heads_than_the_weights_names_the_short_tensor(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The weights are all there, but k/v have fewer rows than num_key_value_heads implies:
    the tensor and the config's shape are named, where this once read as weights missing."""
    model_dir = copy_model(tiny_model_dir, tmp_path / "more-kv-heads")
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    assert config["num_key_value_heads"] < heads
    config["num_key_value_heads"] = heads
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError,
        match=r"k_proj.weight has shape \(32, 64\), where config.json implies \(64, 64\)",
    ) as info:
        load_tiny(model_dir)
    assert "num_key_value_heads" in str(info.value) and "lacks weights" not in str(info.value)


def copy_model(source: Path, model_dir: Path) -> Path:
    shutil.copytree(source, model_dir)
    return model_dir


def load_tiny(model_dir: Path) -> object:
    return load_model(model_dir, torch.device("cpu"), torch.float32, TorchAttentionBackend())


def edit_weights(model_dir: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, model_dir / "model.safetensors")


def test_a_query_tensor_larger_than_its_rows_is_named_not_counted(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """80 rows of q_proj where the config implies 64: the slice once took 80 rows of the fused
    qkv (running into k), and only the value count caught it, as "smaller than config.json"."""
    model_dir = copy_model(tiny_model_dir, tmp_path / "big-q")
    name = "model.layers.0.self_attn.q_proj.weight"

    def grow(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = torch.cat([tensors[name], tensors[name][:16]])

    edit_weights(model_dir, grow)
    with pytest.raises(
        ModelLoadError, match=rf"{name} has shape \(80, 64\), where config.json implies \(64, 64\)"
    ):
        load_tiny(model_dir)


def test_a_scalar_tensor_is_named(tmp_path: Path, tiny_model_dir: Path) -> None:
    model_dir = copy_model(tiny_model_dir, tmp_path / "scalar")
    name = "model.layers.0.self_attn.q_proj.weight"

    def scalar(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = torch.tensor(1.0)

    edit_weights(model_dir, scalar)
    with pytest.raises(ModelLoadError, match=rf"{name} has shape \(\)"):
        load_tiny(model_dir)


def test_two_weight_files_holding_the_same_tensors_say_so(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    model_dir = copy_model(tiny_model_dir, tmp_path / "twice")
    shutil.copy(model_dir / "model.safetensors", model_dir / "consolidated.safetensors")
    with pytest.raises(ModelLoadError, match="holds a tensor more than once"):
        load_tiny(model_dir)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_an_unreadable_safetensors_file_is_a_model_load_error_naming_it(
    tmp_path: Path, tiny_model_dir: Path, damage: str
) -> None:
    model_dir = copy_model(tiny_model_dir, tmp_path / damage)
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\xff" * 4096)
    with pytest.raises(ModelLoadError, match=f"cannot read weights {weights}"):
        load_tiny(model_dir)


def test_hf_dir_resolves_as_is(tiny_model_dir: Path) -> None:
    resolved = resolve_model(tiny_model_dir)
    assert resolved.hf_dir == tiny_model_dir
    assert not resolved.is_gguf
    assert resolved.name == tiny_model_dir.name
    assert resolved.weights_hash == resolve_model(str(tiny_model_dir)).weights_hash


@pytest.fixture(scope="module")
def tokenizer_fields() -> dict[str, Any]:
    """GGUF tokenizer metadata for synthetic files: a byte-level BPE vocabulary of the 256 bytes
    and one merge (the real 49152-token one took transformers' GGUF reader seconds per file)."""
    from vbatch.models.gguf_tokenizer import byte_alphabet

    tokens = [*byte_alphabet().values(), "\u0120t"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * len(tokens),
        "tokenizer.ggml.merges": ["\u0120 t"],
        "tokenizer.chat_template": "{% for m in messages %}{{ m.content }}\n{% endfor %}",
    }


def write_gguf(
    path: Path,
    arch: str,
    reference: torch.nn.Module,
    tokenizer_fields: dict[str, Any],
    metadata: dict[str, Any] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> None:
    """A float32 GGUF laid out as llama.cpp's converter does (Q/K permuted for llama);
    `metadata` replaces values (an int as uint32, a float as float32, a str as string);
    `extra_tensors` are written
    first, under their GGUF names."""
    import gguf

    config = reference.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_uint32(f"{arch}.block_count", config.num_hidden_layers)
    writer.add_uint32(f"{arch}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", config.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", config.num_key_value_heads)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", config.rope_parameters["rope_theta"])
    if config.model_type == "mistral":
        writer.add_uint32(f"{arch}.attention.sliding_window", config.sliding_window)
    writer.add_tokenizer_model(tokenizer_fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(tokenizer_fields["tokenizer.ggml.pre"])
    writer.add_token_list(tokenizer_fields["tokenizer.ggml.tokens"])
    writer.add_token_types(tokenizer_fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(tokenizer_fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(tokenizer_fields["tokenizer.chat_template"])
    for key, value in (metadata or {}).items():
        if isinstance(value, float):
            writer.add_float32(key, value)
        else:
            (writer.add_uint32 if isinstance(value, int) else writer.add_string)(key, value)
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    names |= {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    names |= {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    names |= {"q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    for name, tensor in reference.state_dict().items():
        array = tensor.numpy()
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", array)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", array)
        elif name == "lm_head.weight":
            if not config.tie_word_embeddings:
                writer.add_tensor("output.weight", array)
        else:
            parts = name.split(".")
            layer, part, kind = parts[2], parts[-2], parts[-1]
            heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
            if arch == "llama" and part in heads and kind == "weight":
                half = array.shape[0] // heads[part] // 2
                array = array.reshape(heads[part], 2, half, -1).swapaxes(1, 2).reshape(array.shape)
            writer.add_tensor(f"blk.{layer}.{names[part]}.{kind}", np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_synthetic_gguf_round_trips(
    family: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tokenizer_fields: dict[str, Any],
) -> None:
    """A Mistral GGUF is a llama one with a sliding window; Qwen3 adds per-head q/k norms."""
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    monkeypatch.setenv("VBATCH_CACHE_DIR", str(tmp_path / "cache"))
    arch = "llama" if family == "mistral" else family
    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    config = (classes | {"mistral": MistralConfig})[family](
        vocab_size=len(tokenizer_fields["tokenizer.ggml.tokens"]),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=32,
        tie_word_embeddings=arch == "llama",
    )
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_()
    write_gguf(tmp_path / f"tiny-{arch}.gguf", arch, reference, tokenizer_fields)
    resolved = resolve_model(tmp_path / f"tiny-{arch}.gguf")
    assert resolved.hf_dir.is_relative_to(tmp_path / "cache")
    converted = load_file(resolved.hf_dir / "model.safetensors")
    expected = reference.state_dict()
    if arch == "llama":
        del expected["lm_head.weight"]
    assert converted.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(converted[name], tensor, atol=0, rtol=0, msg=name)
    got = ModelConfig.from_hf_dir(resolved.hf_dir)
    assert got.architecture == type(reference).__name__
    assert got.tie_word_embeddings == (arch == "llama")
    assert got.attention_bias == (arch == "qwen2")
    assert got.qk_norm == (arch == "qwen3")
    assert got.sliding_windows == ((32, 32) if family == "mistral" else ())
    assert (got.num_attention_heads, got.num_key_value_heads, got.head_dim) == (4, 2, 16)
    assert got.rope_theta == config.rope_parameters["rope_theta"]
    assert got.rms_norm_eps == pytest.approx(config.rms_norm_eps)
    assert (got.bos_token_id, got.eos_token_ids) == (1, (2,))
    assert resolve_model(tmp_path / f"tiny-{arch}.gguf") == resolved


def test_a_new_conversion_removes_the_same_files_older_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer_fields: dict[str, Any]
) -> None:
    """A conversion version bump leaves a model-sized directory of the old one behind; the new
    conversion removes the same file's, and no other file's."""
    monkeypatch.setenv("VBATCH_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    reference = tiny_rope_reference(tokenizer_fields, {"rope_type": "default"})
    write_gguf(path, "llama", reference, tokenizer_fields)
    gguf_dir = cache_dir() / "gguf"
    stem = hash_files([path])[:16]
    older = [gguf_dir / f"{stem}-v{version}" for version in (1, CONVERSION_VERSION - 1)]
    other = gguf_dir / f"{'f' * 16}-v1"
    for directory in (*older, other):
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(b"old")
    resolved = resolve_model(path)
    assert resolved.hf_dir == gguf_dir / f"{stem}-v{CONVERSION_VERSION}"
    assert not any(directory.exists() for directory in older)
    assert (other / "model.safetensors").read_bytes() == b"old"


def llama3_rope_freqs(head_dim: int, theta: float, rope: dict[str, float]) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for a llama3 rope scaling: each rotary
    pair's frequency divisor, 1 for short wavelengths, `factor` for long ones, blended between."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / freqs
    original = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    smooth = (original / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelen < original / high, 1.0, blended)
    return np.where(wavelen > original / low, factor, divisors).astype(np.float32)


def tiny_rope_reference(
    tokenizer_fields: dict[str, Any], rope_parameters: dict[str, Any]
) -> torch.nn.Module:
    """A 2-layer Llama with head dim 16 (8 rotary pairs), `rope_parameters` and weights of std
    0.3, so that a rotation wrong anywhere shows in its logits."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer_fields["tokenizer.ggml.tokens"]),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters={"rope_theta": 10000.0, **rope_parameters},
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(std=0.3)
    return reference


LLAMA3_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_a_llama3_gguf_rotates_by_its_rope_freqs(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tokenizer_fields: dict[str, Any],
    make_attention_metadata: Callable,
) -> None:
    """Llama 3.1 and 3.2 GGUFs carry their llama3 rope scaling as `rope_freqs.weight`: vbatch's
    logits, and transformers' on the converted directory, match transformers' llama3 model the
    file was written from, on both sides of the pre-training length."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("VBATCH_CACHE_DIR", str(tmp_path / "cache"))
    reference = tiny_rope_reference(tokenizer_fields, {"rope_type": "llama3", **LLAMA3_ROPE})
    rope_freqs = llama3_rope_freqs(16, 10000.0, LLAMA3_ROPE)
    assert rope_freqs.min() == 1.0 and rope_freqs.max() == 8.0
    assert ((rope_freqs > 1.0) & (rope_freqs < 8.0)).any()
    path = tmp_path / "tiny-llama3.gguf"
    write_gguf(
        path, "llama", reference, tokenizer_fields, extra_tensors={"rope_freqs.weight": rope_freqs}
    )
    resolved = resolve_model(path)
    converted_config = ModelConfig.from_hf_dir(resolved.hf_dir)
    assert converted_config.rope_scaling["rope_type"] == "longrope"
    assert converted_config.long_rope_from is None

    ids = torch.randint(0, 257, (100,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = reference(ids[None]).logits[0]
        converted = AutoModelForCausalLM.from_pretrained(resolved.hf_dir, dtype=torch.float32)
        torch.testing.assert_close(converted.eval()(ids[None]).logits[0], expected)
    model = load_model(resolved, torch.device("cpu"), torch.float32, TorchAttentionBackend())
    assert model.long_rope_offset is None
    logits = prefill_logits(model, ids, make_attention_metadata)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("metadata", "factor"),
    [
        ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, 4.0),
        ({"llama.rope.scaling.factor": 4.0}, 4.0),
        ({"llama.rope.scale_linear": 4.0}, 4.0),
        ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}, None),
        ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, None),
    ],
)
def test_a_gguf_linear_rope_factor_is_read_as_llama_cpp_reads_it(
    metadata: dict[str, Any],
    factor: float | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tokenizer_fields: dict[str, Any],
    make_attention_metadata: Callable,
) -> None:
    """llama.cpp takes the factor from rope.scaling.factor, else the older rope.scale_linear, a
    file without rope.scaling.type as linear, and a factor of 0 as none; a file with only the
    factor, or only the older key, ran unscaled here, every position rotated wrong."""
    monkeypatch.setenv("VBATCH_CACHE_DIR", str(tmp_path / "cache"))
    rope = {"rope_type": "default"} if factor is None else {"rope_type": "linear", "factor": factor}
    reference = tiny_rope_reference(tokenizer_fields, rope)
    path = tmp_path / "tiny-linear.gguf"
    write_gguf(path, "llama", reference, tokenizer_fields, metadata)
    model = load_model(
        resolve_model(path), torch.device("cpu"), torch.float32, TorchAttentionBackend()
    )
    ids = torch.randint(0, 257, (100,), generator=torch.Generator().manual_seed(1))
    logits = prefill_logits(model, ids, make_attention_metadata)
    with torch.inference_mode():
        expected = reference(ids[None]).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("metadata", "rope_freqs", "message"),
    [
        ({}, "short", r"rope_freqs\.weight must hold 8 numbers, one per rotary pair, got 5"),
        ({}, "zero", r"rope_freqs\.weight must hold positive numbers, got 0\.0 for rotary pair 3"),
        ({}, "nan", r"rope_freqs\.weight must hold positive numbers, got nan for rotary pair 3"),
        (
            {"llama.rope.scaling.factor": -2.0},
            "llama3",
            r"rope\.scaling\.factor must be a positive",
        ),
        ({"llama.rope.scaling.factor": -2.0}, None, r"rope\.scaling\.factor must be a positive"),
        ({"llama.rope.scale_linear": float("inf")}, None, r"rope\.scale_linear must be a positive"),
    ],
)
def test_a_malformed_gguf_rope_is_a_model_load_error(
    metadata: dict[str, Any],
    rope_freqs: str | None,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tokenizer_fields: dict[str, Any],
) -> None:
    """A rope_freqs tensor of the wrong length or with a value that divides no frequency, and a
    negative or infinite linear factor (which, beside rope_freqs, made NaN logits), are refused
    at load, each naming what is wrong."""
    monkeypatch.setenv("VBATCH_CACHE_DIR", str(tmp_path / "cache"))
    reference = tiny_rope_reference(tokenizer_fields, {"rope_type": "default"})
    extra = {}
    if rope_freqs is not None:
        freqs = llama3_rope_freqs(16, 10000.0, LLAMA3_ROPE)
        if rope_freqs == "short":
            freqs = freqs[:5]
        elif rope_freqs in ("zero", "nan"):
            freqs[3] = 0.0 if rope_freqs == "zero" else np.nan
        extra["rope_freqs.weight"] = freqs
    path = tmp_path / "bad-rope.gguf"
    write_gguf(path, "llama", reference, tokenizer_fields, metadata, extra_tensors=extra)
    with pytest.raises(ModelLoadError, match=message):
        resolve_model(path)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"general.alignment": 0}, "cannot read GGUF file"),
        ({"llama.attention.head_count_kv": 0}, "cannot convert GGUF file .*: bad metadata"),
        ({"llama.attention.layer_norm_rms_epsilon": "abc"}, "cannot convert GGUF file .*: bad"),
    ],
)
def test_gguf_metadata_of_the_wrong_value_is_a_model_load_error(
    metadata: dict[str, Any],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tokenizer_fields: dict[str, Any],
) -> None:
    """A zero alignment or head count, a string epsilon: these escaped as ZeroDivisionError or
    ValueError, which the CLI reported as a bug in vbatch."""
    monkeypatch.setenv("VBATCH_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "bad.gguf"
    reference = tiny_rope_reference(tokenizer_fields, {"rope_type": "default"})
    write_gguf(path, "llama", reference, tokenizer_fields, metadata)
    with pytest.raises(ModelLoadError, match=message):
        resolve_model(path)
    assert not list((tmp_path / "cache" / "gguf").glob(".converting-*"))


def test_a_weights_link_whose_file_is_gone_is_an_incomplete_download(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").symlink_to(tmp_path / "blob-gone")
    with pytest.raises(ModelLoadError, match=r"lacks model\.safetensors .*download is incomplete"):
        weight_files(model)


def test_unsupported_gguf_architecture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf

    monkeypatch.setenv("VBATCH_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=f"{path}.*unsupported architecture 'gpt2'"):
        resolve_model(path)
