"""LlamaForCausalLM against transformers on tiny random Llama, Mistral and Qwen2 models."""

from __future__ import annotations

import copy
import dataclasses
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
)

from vbatch.layers import native
from vbatch.layers.attention import TorchAttentionBackend
from vbatch.layers.linear_choice import TIMED_ROWS, forced_everywhere
from vbatch.models.config import ModelConfig
from vbatch.models.llama import (
    LM_HEAD_CHUNK,
    MAX_TRANSPOSED_ROWS,
    LlamaForCausalLM,
    LlamaMLP,
    load_model,
)

TOLERANCE = 1e-4
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama-tied": lambda: LlamaConfig(
        **SHAPE, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True
    ),
    "llama-gqa-llama3-rope": lambda: LlamaConfig(
        **SHAPE,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2-bias-linear-rope": lambda: Qwen2Config(
        **SHAPE,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
    "mistral": lambda: MistralConfig(
        **SHAPE, num_attention_heads=4, num_key_value_heads=1, sliding_window=None
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[torch.nn.Module, LlamaForCausalLM]:
    """(transformers reference, vbatch model) sharing random weights large enough to matter."""
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(CONFIGS[request.param]()).float().eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif param.dim() == 2:
                param.normal_(0.0, param.shape[1] ** -0.5 if "embed" not in name else 1.0)
            else:
                param.normal_(0.0, 0.1)
    out_dir = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(out_dir, safe_serialization=True)
    model = load_model(out_dir, torch.device("cpu"), torch.float32, TorchAttentionBackend())
    return reference, model


def reference_logits(reference: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(torch.tensor([ids])).logits[0]


def make_kv_caches(config: ModelConfig, num_blocks: int, block_size: int) -> list:
    """Caches full of large finite garbage: any unmasked read of an unwritten slot shows."""
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [
        (1e3 * torch.randn(shape), 1e3 * torch.randn(shape))
        for _ in range(config.num_hidden_layers)
    ]


def test_config_reads_hf_fields(model_pair: tuple[torch.nn.Module, LlamaForCausalLM]) -> None:
    reference, model = model_pair
    config = model.config
    assert config.architecture == type(reference).__name__
    assert config.tie_word_embeddings == reference.config.tie_word_embeddings
    assert (model.lm_head is None) == config.tie_word_embeddings
    assert config.attention_bias == (config.architecture == "Qwen2ForCausalLM")
    rope = reference.config.rope_parameters
    assert config.rope_theta == rope["rope_theta"]
    assert (config.rope_scaling or {}).get("rope_type", "default") == rope["rope_type"]
    o_proj = model.layers[0].self_attn.o_proj
    assert config.head_dim * config.num_attention_heads == o_proj.in_features


def test_full_prefill_matches_transformers(
    model_pair: tuple[torch.nn.Module, LlamaForCausalLM], make_attention_metadata: Callable
) -> None:
    reference, model = model_pair
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (13, 40, 1)]
    block_size = 8
    pool = list(range(32))
    rng.shuffle(pool)
    block_tables = []
    for ids in prompts:
        num_blocks = -(-len(ids) // block_size)
        block_tables.append([pool.pop() for _ in range(num_blocks)])
    lens = [len(ids) for ids in prompts]
    meta = make_attention_metadata(lens, lens, block_tables, block_size)
    kv_caches = make_kv_caches(model.config, 32, block_size)
    input_ids = torch.tensor([t for ids in prompts for t in ids])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        logits = model.compute_logits(model(input_ids, positions, kv_caches, meta))
    expected = torch.cat([reference_logits(reference, ids) for ids in prompts])
    assert logits.dtype == torch.float32
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(logits, expected, atol=TOLERANCE, rtol=0)


def native_copy(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The same weights on the native attention backend and fused RMSNorm and rotary ops."""
    if not native.is_available():
        pytest.skip("native kernels could not be built here")
    clone = LlamaForCausalLM(model.config, native.NativeAttentionBackend(), use_native_ops=True)
    clone.load_state_dict(model.state_dict())
    return clone.eval()


@pytest.mark.parametrize(
    ("device", "ops"),
    [("cpu", "torch"), ("cpu", "native"), pytest.param("cuda", "torch", marks=pytest.mark.gpu)],
)
def test_chunked_prefill_and_decode_match_transformers(
    model_pair: tuple[torch.nn.Module, LlamaForCausalLM],
    make_attention_metadata: Callable,
    device: str,
    ops: str,
) -> None:
    """Ragged sequences advance in random chunks through shuffled 4-token blocks."""
    reference, model = model_pair
    if ops == "native":
        model = native_copy(model)
    model = copy.deepcopy(model).to(device) if device != "cpu" else model
    tolerance = TOLERANCE if device == "cpu" else 1e-3
    rng = random.Random(2)
    block_size, num_blocks = 4, 64
    seqs = [[rng.randrange(256) for _ in range(n)] for n in (23, 9, 31, 17)]
    prefill_lens = [7, 3, 12, 1]
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    block_tables = [[pool.pop() for _ in range(-(-len(s) // block_size))] for s in seqs]
    kv_caches = [
        (k.to(device), v.to(device))
        for k, v in make_kv_caches(model.config, num_blocks, block_size)
    ]
    num_computed = [0] * len(seqs)
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    num_decode_only_steps = num_mixed_steps = 0
    while any(done < len(s) for done, s in zip(num_computed, seqs, strict=True)):
        batch = []
        for i, ids in enumerate(seqs):
            if num_computed[i] == len(ids):
                continue
            is_prefill = num_computed[i] < prefill_lens[i]
            chunk = rng.randint(1, prefill_lens[i] - num_computed[i]) if is_prefill else 1
            batch.append((i, chunk))
        query_lens = [chunk for _, chunk in batch]
        seq_lens = [num_computed[i] + chunk for i, chunk in batch]
        num_decode_only_steps += max(query_lens) == 1
        num_mixed_steps += max(query_lens) > 1 and min(query_lens) == 1
        meta = make_attention_metadata(
            query_lens, seq_lens, [block_tables[i] for i, _ in batch], block_size, device
        )
        input_ids = torch.tensor(
            [t for (i, q), n in zip(batch, seq_lens, strict=True) for t in seqs[i][n - q : n]]
        )
        positions = torch.cat(
            [torch.arange(n - q, n) for q, n in zip(query_lens, seq_lens, strict=True)]
        )
        with torch.inference_mode():
            hidden = model(input_ids.to(device), positions.to(device), kv_caches, meta)
            logits = model.compute_logits(hidden).cpu()
        for (i, chunk), rows in zip(batch, logits.split(query_lens), strict=True):
            got[i].append(rows)
            num_computed[i] += chunk
    assert num_decode_only_steps > 5 and num_mixed_steps > 0
    for i, ids in enumerate(seqs):
        torch.testing.assert_close(
            torch.cat(got[i]), reference_logits(reference, ids), atol=tolerance, rtol=0
        )


def test_missing_weight_is_reported(tmp_path: Path, model_pair: tuple) -> None:
    from safetensors.torch import load_file, save_file

    from vbatch.errors import ModelLoadError

    reference, _ = model_pair
    reference.save_pretrained(tmp_path, safe_serialization=True)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.gate_up_proj\.weight"):
        load_model(tmp_path, torch.device("cpu"), torch.float32, TorchAttentionBackend())


def test_bfloat16_tracks_float32(
    model_pair: tuple[torch.nn.Module, LlamaForCausalLM], make_attention_metadata: Callable
) -> None:
    reference, model = model_pair
    model = copy.deepcopy(model).to(torch.bfloat16)
    ids = list(range(3, 40))
    meta = make_attention_metadata([len(ids)], [len(ids)], [list(range(5))], 8)
    kv_caches = [
        (k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in make_kv_caches(model.config, 5, 8)
    ]
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), kv_caches, meta)
        logits = model.compute_logits(hidden)
    assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.float32
    expected = reference_logits(reference, ids)
    similarity = F.cosine_similarity(logits, expected, dim=-1)
    assert similarity.min() > 0.99, similarity.min()


@pytest.mark.parametrize("head_backend", ["torch", "native"])
def test_greedy_token_ids_match_argmax_of_logits(tiny_model_dir: Path, head_backend: str) -> None:
    """The chunked argmax (native: fused into the head's GEMM) agrees with the full logits, and a
    tie across chunks picks the first."""
    model = load_model(tiny_model_dir, torch.device("cpu"), torch.float32, TorchAttentionBackend())
    if head_backend == "native":
        if not native.is_available():
            pytest.skip("needs the native kernels")
        model.use_linear_choice(forced_everywhere("native", has_head=True))
        assert model.head_backends == ["native"] * len(TIMED_ROWS)
    weight = model.embed_tokens.weight
    assert weight.shape[0] > 3 * LM_HEAD_CHUNK
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, weight.shape[1], generator=gen)
    with torch.inference_mode():
        weight[LM_HEAD_CHUNK + 7] = weight[7]
        weight[3 * LM_HEAD_CHUNK + 7] = weight[7]
        hidden[0] = 10 * weight[7]
        expected = model.compute_logits(hidden).argmax(dim=-1)
        got = model.greedy_token_ids(hidden)
    assert got.dtype == torch.int64
    assert torch.equal(got, expected)
    assert got[0] == 7


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_logit_tiles_and_target_logits_match_compute_logits(
    tiny_model_dir: Path, softcap: float | None
) -> None:
    model = load_model(tiny_model_dir, torch.device("cpu"), torch.float32, TorchAttentionBackend())
    model.config = dataclasses.replace(model.config, final_logit_softcapping=softcap)
    hidden = torch.randn(23, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, model.config.vocab_size, (23,))
    with torch.inference_mode():
        expected = model.compute_logits(hidden)
        tiles = [(start, tile.clone()) for start, tile in model.logit_tiles(hidden)]
        targeted = model.target_logits(hidden, targets)
    assert [start for start, _ in tiles] == list(range(0, expected.shape[1], LM_HEAD_CHUNK))
    assert torch.equal(torch.cat([tile for _, tile in tiles], 1), expected)
    torch.testing.assert_close(targeted, expected.gather(1, targets[:, None])[:, 0])


@pytest.mark.parametrize("num_tokens", [1, 7, 8, 13, 64, 119, MAX_TRANSPOSED_ROWS])
def test_transposed_mlp_matches_the_plain_one(num_tokens: int) -> None:
    """W @ x^T with rows padded to a multiple of 8 gives x @ W^T's result for any row count."""
    raw = LlamaConfig(**SHAPE, num_attention_heads=4).to_dict()
    config = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]})
    torch.manual_seed(0)
    mlp = LlamaMLP(config)
    x = torch.randn(num_tokens, config.hidden_size)
    with torch.inference_mode():
        gate, up = mlp.gate_up_proj(x).split(config.intermediate_size, dim=-1)
        expected = mlp.down_proj(F.silu(gate) * up)
        got = mlp(x)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_loading_does_not_import_dynamo_or_sympy(tiny_model_dir: Path) -> None:
    """Start-up stays lean: building the model on the meta device runs no random init, whose
    meta-device path imports torch._dynamo (about a second), and its parameters get storage
    without an op on a meta tensor, which imports sympy (`to_empty`: about a second)."""
    code = (
        "import sys, torch\n"
        "from vbatch.layers.attention import TorchAttentionBackend\n"
        "from vbatch.models.llama import load_model\n"
        f"m = load_model({str(tiny_model_dir)!r}, torch.device('cpu'), torch.bfloat16,"
        " TorchAttentionBackend())\n"
        "print(sorted({'torch._dynamo', 'sympy'} & set(sys.modules)))\n"
        "print(sorted({(str(p.dtype), p.device.type, p.requires_grad) for p in m.parameters()}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.splitlines() == ["[]", "[('torch.bfloat16', 'cpu', False)]"]


def rounded_copy(reference: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The float32 reference with every weight rounded to `dtype`, so both precisions hold it."""
    rounded = copy.deepcopy(reference)
    with torch.no_grad():
        for param in rounded.parameters():
            param.copy_(param.to(dtype))
    return rounded


def save_16bit_shards(rounded: torch.nn.Module, dtype: torch.dtype, out_dir: Path) -> Path:
    """`rounded` saved in `dtype`, in more than two shards, with a consolidated copy beside them
    that the shard index does not name (as some Mistral repos ship)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    copy.deepcopy(rounded).to(dtype).save_pretrained(out_dir, max_shard_size="40KB")
    shards = sorted(out_dir.glob("model-*.safetensors"))
    assert len(shards) > 2 and (out_dir / "model.safetensors.index.json").is_file()
    with safe_open(str(shards[0]), framework="pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == dtype
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, out_dir / "consolidated.safetensors")
    return out_dir


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sharded_16bit_checkpoint_loads_as_its_float32_copy(
    dtype: torch.dtype,
    model_pair: tuple[torch.nn.Module, LlamaForCausalLM],
    tmp_path: Path,
    make_attention_metadata: Callable,
) -> None:
    """On CPU a sharded 16-bit checkpoint loads as the same weights saved in float32 in one
    file: the same parameters bit for bit, and transformers' logits; asked for its own dtype,
    it keeps it."""
    reference = rounded_copy(model_pair[0], dtype)
    reference.save_pretrained(tmp_path / "float32")
    sharded = save_16bit_shards(reference, dtype, tmp_path / "sharded")
    cpu, backend = torch.device("cpu"), TorchAttentionBackend()
    expected = load_model(tmp_path / "float32", cpu, torch.float32, backend).state_dict()
    model = load_model(sharded, cpu, torch.float32, backend)
    assert (model.lm_head is None) == reference.config.tie_word_embeddings
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, expected[name]), name
    for name, tensor in load_model(sharded, cpu, dtype, backend).state_dict().items():
        assert tensor.dtype == dtype and torch.equal(tensor, expected[name].to(dtype)), name
    ids = list(range(3, 30))
    meta = make_attention_metadata([len(ids)], [len(ids)], [list(range(4))], 8)
    kv_caches = make_kv_caches(model.config, 4, 8)
    with torch.inference_mode():
        logits = model.compute_logits(
            model(torch.tensor(ids), torch.arange(len(ids)), kv_caches, meta)
        )
    torch.testing.assert_close(logits, reference_logits(reference, ids), atol=TOLERANCE, rtol=0)


def test_every_family_loads_from_bf16_shards(
    tiny_families: dict[str, tuple[torch.nn.Module, Path]], tmp_path: Path
) -> None:
    """Fused (Phi-3), per-expert (Mixtral, Qwen3-MoE) and offset-norm (Gemma) tensors spread
    over shards load as the float32 copy of the same weights does."""
    cpu, backend = torch.device("cpu"), TorchAttentionBackend()
    for name, (model, _) in tiny_families.items():
        reference = rounded_copy(model, torch.bfloat16)
        reference.save_pretrained(tmp_path / name / "float32")
        sharded = save_16bit_shards(reference, torch.bfloat16, tmp_path / name / "sharded")
        expected = load_model(tmp_path / name / "float32", cpu, torch.float32, backend)
        got = load_model(sharded, cpu, torch.float32, backend).state_dict()
        for param, tensor in expected.state_dict().items():
            assert torch.equal(got[param], tensor), f"{name}: {param}"


@pytest.mark.gpu
def test_a_sharded_bf16_checkpoint_stays_bf16_on_cuda(
    model_pair: tuple[torch.nn.Module, LlamaForCausalLM], tmp_path: Path
) -> None:
    from vbatch.engine.kv_cache import select_dtype

    cuda = torch.device("cuda")
    assert select_dtype("auto", cuda) == torch.bfloat16
    reference = rounded_copy(model_pair[0], torch.bfloat16)
    sharded = save_16bit_shards(reference, torch.bfloat16, tmp_path / "sharded")
    expected = load_model(sharded, torch.device("cpu"), torch.float32, TorchAttentionBackend())
    model = load_model(sharded, cuda, torch.bfloat16, TorchAttentionBackend())
    for name, tensor in model.state_dict().items():
        assert tensor.device.type == "cuda" and tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor.cpu(), expected.state_dict()[name].to(torch.bfloat16)), name


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds the tensor's first byte, None for anonymous memory."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5] if len(fields) > 5 and fields[5].startswith("/") else None
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_unfused_float32_weights_load_from_the_file_mapping_fused_ones_by_copy(
    tiny_model_dir: Path,
) -> None:
    """Parameters that are one checkpoint tensor of their own dtype are that tensor, mapped
    from the safetensors file; fused ones (qkv, gate_up) are copies; a cast is a copy."""
    cpu, backend = torch.device("cpu"), TorchAttentionBackend()
    model = load_model(tiny_model_dir, cpu, torch.float32, backend)
    weights = str(tiny_model_dir / "model.safetensors")
    layer = model.layers[0]
    for name, param in [
        ("embed_tokens", model.embed_tokens.weight),
        ("o_proj", layer.self_attn.o_proj.weight),
        ("down_proj", layer.mlp.down_proj.weight),
        ("input_layernorm", layer.input_layernorm.weight),
    ]:
        assert mapped_file(param) == weights, name
    for name, param in [
        ("qkv_proj", layer.self_attn.qkv_proj.weight),
        ("gate_up_proj", layer.mlp.gate_up_proj.weight),
    ]:
        assert mapped_file(param) != weights, name
    widened = load_model(tiny_model_dir, cpu, torch.bfloat16, backend)
    assert mapped_file(widened.layers[0].self_attn.o_proj.weight) != weights
