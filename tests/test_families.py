"""Every supported family beyond Llama against transformers, on the tiny random models of
benchmarks/tiny_model.py: the config hooks each family sets, model-level chunked prefill and
decode through both attention backends, and greedy decoding through the real engine (batching,
chunked prefill, preemption, prefix caching). Contexts run past every sliding window."""

from __future__ import annotations

import copy
import json
import math
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.tiny_model import TINY_SHAPE, tiny_family_configs
from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.errors import ModelLoadError
from vbatch.layers import native
from vbatch.layers.activation import ACTIVATIONS
from vbatch.layers.attention import AttentionBackend, TorchAttentionBackend
from vbatch.layers.rotary import RotaryEmbedding
from vbatch.models import families
from vbatch.models.config import MODEL_TYPES, SUPPORTED_ARCHITECTURES, ModelConfig
from vbatch.models.llama import LlamaForCausalLM, load_model
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams

FAMILIES = sorted(tiny_family_configs())
TOLERANCE = 1e-4
VOCAB = TINY_SHAPE["vocab_size"]


def backend(ops: str) -> AttentionBackend:
    if ops == "torch":
        return TorchAttentionBackend()
    if not native.is_available():
        pytest.skip("native kernels could not be built here")
    return native.NativeAttentionBackend()


def load(model_dir: Path, ops: str) -> LlamaForCausalLM:
    return load_model(model_dir, torch.device("cpu"), torch.float32, backend(ops))


# --- config hooks ---

EXPECTED_HOOKS: dict[str, dict[str, Any]] = {
    "llama-bias": {"attention_bias": True, "o_proj_bias": True, "mlp_bias": True},
    "qwen3": {"qk_norm": True, "head_dim": 24, "tie_word_embeddings": True, "sliding_windows": ()},
    "mistral-sliding": {"sliding_windows": (5, 5), "num_key_value_heads": 1},
    "gemma2": {
        "hidden_act": "gelu_pytorch_tanh",
        "norm_weight_offset": 1.0,
        "sandwich_norms": True,
        "embedding_multiplier": 8.0,
        "attention_scale": 24**-0.5,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 5.0,
        "sliding_windows": (6, None),
        "qk_norm": False,
    },
    "gemma3": {
        "qk_norm": True,
        "sandwich_norms": True,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "sliding_windows": (6, None, 6),
        "rope_theta": 1e6,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "sliding_rope_theta": 10000.0,
        "sliding_rope_scaling": None,
    },
    "phi3-longrope": {"rotary_dim": 8, "head_dim": 16, "sliding_windows": ()},
    "mixtral": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "moe_layers": (True, True),
        "moe_intermediate_size": 96,
    },
    "qwen3-moe": {"qk_norm": True, "norm_topk_prob": False, "moe_layers": (True, False, True)},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_config_hooks(family: str, tiny_families: dict) -> None:
    reference, model_dir = tiny_families[family]
    config = ModelConfig.from_hf_dir(model_dir)
    assert config.architecture == type(reference).__name__
    for name, expected in EXPECTED_HOOKS[family].items():
        assert getattr(config, name) == expected, name


def test_phi3_longrope_settings(tiny_families: dict) -> None:
    scaling = ModelConfig.from_hf_dir(tiny_families["phi3-longrope"][1]).rope_scaling
    assert scaling is not None and scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == 64
    assert scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))


def test_supported_lists_agree() -> None:
    assert set(families.SUPPORTED_ACTIVATIONS) == set(ACTIVATIONS)
    assert {"Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"} <= set(
        SUPPORTED_ARCHITECTURES
    )


def test_unsupported_architecture_names_every_supported_one() -> None:
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_dict({"architectures": ["Gemma3ForConditionalGeneration"]})
    message = str(info.value)
    assert "Gemma3ForConditionalGeneration" in message
    assert all(name in message for name in SUPPORTED_ARCHITECTURES)


BASE = {
    "vocab_size": 32,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


@pytest.mark.parametrize("model_type", sorted(MODEL_TYPES))
def test_a_config_without_architectures_is_read_by_its_model_type(model_type: str) -> None:
    """As transformers' Auto classes read it; the model type names each supported family's
    causal LM, each transformers' own name for the type."""
    import transformers

    assert transformers.AutoConfig.for_model(model_type).model_type == model_type
    config = ModelConfig.from_dict({**BASE, "num_hidden_layers": 2, "model_type": model_type})
    assert config.architecture == MODEL_TYPES[model_type]
    assert set(MODEL_TYPES.values()) == set(SUPPORTED_ARCHITECTURES)


def test_gemma3_hub_config_without_layer_types() -> None:
    """Older Gemma 3 configs: sliding_window_pattern, rope_local_base_freq, rope_scaling."""
    raw = {
        **BASE,
        "architectures": ["Gemma3ForCausalLM"],
        "num_hidden_layers": 12,
        "sliding_window": 512,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    config = ModelConfig.from_dict(raw)
    assert config.sliding_windows == (512,) * 5 + (None,) + (512,) * 5 + (None,)
    assert (config.rope_theta, config.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert (config.sliding_rope_theta, config.sliding_rope_scaling) == (10000.0, None)
    assert config.uses_sliding_rope(0) and not config.uses_sliding_rope(5)


@pytest.mark.parametrize(
    ("architecture", "extra", "windows"),
    [
        ("Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": 8}, ()),
        (
            "Qwen3ForCausalLM",
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
            (None, None, 8, 8),
        ),
        ("MistralForCausalLM", {"sliding_window": 8}, (8,) * 4),
        ("MistralForCausalLM", {"sliding_window": 4096}, ()),  # wider than any context
        ("Phi3ForCausalLM", {"sliding_window": 8}, (8,) * 4),
        ("Gemma2ForCausalLM", {"sliding_window": 8}, (8, None, 8, None)),
    ],
)
def test_sliding_window_layers(architecture: str, extra: dict, windows: tuple) -> None:
    raw = {
        **BASE,
        "architectures": [architecture],
        "num_hidden_layers": 4,
        "max_position_embeddings": 128,
        **extra,
    }
    assert ModelConfig.from_dict(raw).sliding_windows == windows


def test_longrope_table_matches_transformers(tiny_families: dict) -> None:
    """The short factors' rows, as transformers rotates a sequence within the pre-training
    length, then the long factors' for every position (from long_offset on), as it rotates a
    longer one; both scaled by the attention factor."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    reference, model_dir = tiny_families["phi3-longrope"]
    config = ModelConfig.from_hf_dir(model_dir)
    ours = RotaryEmbedding(
        config.rotary_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
    )
    assert ours.long_offset == config.max_position_embeddings
    positions = torch.arange(100)
    cos, sin = (t.float() for t in ours._build(torch.device("cpu"), torch.float32))
    hf_rotary = Phi3RotaryEmbedding(reference.config)
    x = torch.zeros(1)
    short_cos, short_sin = hf_rotary(x, positions[None, :64])
    long_cos, long_sin = hf_rotary(x, positions[None, :100])
    half = config.rotary_dim // 2
    long_rows = slice(ours.long_offset, ours.long_offset + 100)
    torch.testing.assert_close(cos[:64], short_cos[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:64], short_sin[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(cos[long_rows], long_cos[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[long_rows], long_sin[0, :, :half], rtol=0, atol=1e-6)


def test_missing_expert_weight_is_reported(tiny_families: dict, tmp_path: Path) -> None:
    _, model_dir = tiny_families["mixtral"]
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.experts\.gate_up_proj"):
        load(tmp_path, "torch")


def test_fused_expert_checkpoint_loads_alike(tiny_families: dict, tmp_path: Path) -> None:
    """transformers 5's stacked expert tensors load as the per-expert ones do."""
    _, model_dir = tiny_families["qwen3-moe"]
    weights = load_file(model_dir / "model.safetensors")
    for layer in (0, 2):
        prefix = f"model.layers.{layer}.mlp.experts"
        experts = range(4)
        gate_up = [
            torch.cat([weights.pop(f"{prefix}.{e}.{part}_proj.weight") for part in ("gate", "up")])
            for e in experts
        ]
        down = [weights.pop(f"{prefix}.{e}.down_proj.weight") for e in experts]
        weights[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        weights[f"{prefix}.down_proj"] = torch.stack(down)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    fused, per_expert = load(tmp_path, "torch"), load(model_dir, "torch")
    for (name, a), (_, b) in zip(
        fused.state_dict().items(), per_expert.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


# --- model-level equivalence ---


def make_kv_caches(config: ModelConfig, num_blocks: int, block_size: int) -> list:
    """Caches full of large finite garbage: any unmasked read of an unwritten slot shows."""
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [
        (1e3 * torch.randn(shape), 1e3 * torch.randn(shape))
        for _ in range(config.num_hidden_layers)
    ]


@pytest.mark.parametrize("ops", ["torch", "native"])
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_decode_match_transformers(
    family: str, ops: str, tiny_families: dict, make_attention_metadata: Callable
) -> None:
    """Ragged sequences advance in random chunks (some longer than the native kernel's
    per-token limit) through shuffled 4-token blocks, in mixed prefill/decode steps."""
    reference, model_dir = tiny_families[family]
    model = load(model_dir, ops)
    rng = random.Random(2)
    block_size, num_blocks = 4, 48
    seqs = [[rng.randrange(VOCAB) for _ in range(n)] for n in (29, 9, 31, 20)]
    prefill_lens = [18, 3, 12, 1]
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    block_tables = [[pool.pop() for _ in range(-(-len(s) // block_size))] for s in seqs]
    kv_caches = make_kv_caches(model.config, num_blocks, block_size)
    num_computed = [0] * len(seqs)
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(done < len(s) for done, s in zip(num_computed, seqs, strict=True)):
        batch = []
        for i, ids in enumerate(seqs):
            if num_computed[i] < len(ids):
                left = prefill_lens[i] - num_computed[i]
                batch.append((i, rng.randint(1, left) if left > 0 else 1))
        query_lens = [chunk for _, chunk in batch]
        seq_lens = [num_computed[i] + chunk for i, chunk in batch]
        meta = make_attention_metadata(
            query_lens, seq_lens, [block_tables[i] for i, _ in batch], block_size
        )
        input_ids = torch.tensor(
            [t for (i, q), n in zip(batch, seq_lens, strict=True) for t in seqs[i][n - q : n]]
        )
        positions = torch.cat(
            [torch.arange(n - q, n) for q, n in zip(query_lens, seq_lens, strict=True)]
        )
        with torch.inference_mode():
            logits = model.compute_logits(model(input_ids, positions, kv_caches, meta))
        for (i, chunk), rows in zip(batch, logits.split(query_lens), strict=True):
            got[i].append(rows)
            num_computed[i] += chunk
    for ids, rows in zip(seqs, got, strict=True):
        with torch.inference_mode():
            expected = reference(torch.tensor([ids])).logits[0]
        assert expected.abs().max() > 1.0
        torch.testing.assert_close(torch.cat(rows), expected, atol=TOLERANCE, rtol=0)


# --- the engine ---


def engine_prompts() -> list[list[int]]:
    """Six prompts of 9-27 tokens, four sharing an 8-token prefix (two 4-token blocks)."""
    rng = random.Random(5)
    prefix = [rng.randrange(VOCAB) for _ in range(8)]
    prompts = []
    for i, n in enumerate((19, 9, 27, 14, 22, 11)):
        head = prefix if i % 3 != 1 else [rng.randrange(VOCAB) for _ in range(8)]
        prompts.append(head + [rng.randrange(VOCAB) for _ in range(n - 8)])
    return prompts


def generate(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, ids in enumerate(prompts):
        assert core.add_request(AddRequest(f"r{i}", pack_token_ids(ids), params)) == []
    while core.has_unfinished():
        out = core.step()
        for request_id, token_id in zip(out.request_ids, out.token_ids, strict=True):
            tokens[request_id].append(token_id)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("ops", ["torch", "native"])
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_matches_transformers(
    family: str, ops: str, tiny_families: dict, greedy_check: Callable
) -> None:
    """Through EngineCore: 8-token chunked prefill over 4-token blocks, a KV pool too small for
    every sequence (preemption and recompute), shared prompt prefixes (prefix-cache hits)."""
    backend(ops)  # skips when native is asked for and unavailable
    reference, model_dir = tiny_families[family]
    config = EngineConfig(
        model=str(model_dir),
        attention_backend=ops,
        block_size=4,
        max_num_batched_tokens=8,
        # NOTE: an all-windowed model releases the blocks behind its window, so it needs a
        # smaller pool to preempt.
        num_kv_blocks=8 if family == "mistral-sliding" else 14,
        max_num_seqs=4,
    )
    core = EngineCore(config)
    assert core.runner.attn_backend.name == ops
    prompts = engine_prompts()
    # NOTE: Phi-3's longrope matches transformers only within its pre-training length (64).
    got = generate(core, prompts, max_tokens=12)
    assert all(len(tokens) == 12 for tokens in got)
    greedy_check(reference, prompts, got)
    stats = core.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0


def test_gemma_norm_offset_is_in_the_weights(tiny_families: dict) -> None:
    """Gemma's (1 + w) norms load as Llama norms holding 1 + w."""
    reference, model_dir = tiny_families["gemma3"]
    model = load(model_dir, "torch")
    hf_weight = reference.model.layers[0].self_attn.q_norm.weight
    torch.testing.assert_close(model.layers[0].self_attn.q_norm.weight, 1.0 + hf_weight)
    raw = json.loads((model_dir / "config.json").read_text())
    assert raw["architectures"] == ["Gemma3ForCausalLM"]


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_tracks_transformers(
    family: str, tiny_families: dict, make_attention_metadata: Callable
) -> None:
    """Loaded straight into bfloat16 (Gemma's norm offset added before the rounding), every
    family stays close to transformers run in bfloat16 too. (Against float32 an MoE model can
    route a token differently: transformers' own bfloat16 run does.)"""
    reference, model_dir = tiny_families[family]
    model = load_model(model_dir, torch.device("cpu"), torch.bfloat16, TorchAttentionBackend())
    ids = list(range(3, 40))
    meta = make_attention_metadata([len(ids)], [len(ids)], [list(range(5))], 8)
    kv_caches = [
        (k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in make_kv_caches(model.config, 5, 8)
    ]
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), kv_caches, meta)
        logits = model.compute_logits(hidden)
        expected = copy.deepcopy(reference).to(torch.bfloat16)(torch.tensor([ids])).logits[0]
    assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.float32
    similarity = torch.nn.functional.cosine_similarity(logits, expected.float(), dim=-1)
    assert similarity.min() > 0.999, similarity.min()


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("ops", ["torch", "native"])
def test_window_bounds_the_kv_blocks_of_long_prompts(
    ops: str, is_async: bool, tiny_families: dict, greedy_check: Callable
) -> None:
    """Mistral with a 5-token window on every layer: two 150-token prompts sharing 100 tokens
    run on a pool of 12 4-token blocks (their 170 tokens would need 43 each), as the blocks
    behind the window are released; every greedy token is still transformers', with the
    next decode step planned ahead or not."""
    backend(ops)
    reference, model_dir = tiny_families["mistral-sliding"]
    config = EngineConfig(
        model=str(model_dir),
        attention_backend=ops,
        block_size=4,
        max_num_batched_tokens=8,
        num_kv_blocks=12,
        max_num_seqs=2,
        async_scheduling=is_async,
    )
    core = EngineCore(config)
    block_manager = core.scheduler.block_manager
    assert block_manager.sliding_window == 5 and core.scheduler.max_live_blocks == 7
    rng = random.Random(7)
    shared = [rng.randrange(VOCAB) for _ in range(100)]
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(50)] for _ in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, ids in enumerate(prompts):
        assert core.add_request(AddRequest(f"r{i}", pack_token_ids(ids), params)) == []
    tokens: dict[str, list[int]] = {"r0": [], "r1": []}
    num_released = 0
    while core.has_unfinished():
        out = core.step()
        for request_id, token_id in zip(out.request_ids, out.token_ids, strict=True):
            tokens[request_id].append(token_id)
        for seq in core.scheduler.running:
            assert len(seq.block_table) - seq.num_dropped_blocks <= core.scheduler.max_live_blocks
            assert seq.num_dropped_blocks * 4 <= max(0, seq.num_computed_tokens - 5)
            num_released = max(num_released, seq.num_dropped_blocks)
    got = [tokens["r0"], tokens["r1"]]
    assert all(len(t) == 20 for t in got)
    greedy_check(reference, prompts, got)
    assert num_released > 30 and block_manager.num_free_blocks == 12


def _transformers_rope(raw: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    import transformers

    (tmp_path / "config.json").write_text(json.dumps(raw))
    return transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters


def test_a_rope_scaling_beside_rope_parameters_wins_as_in_transformers(tmp_path: Path) -> None:
    """A transformers-5 config (rope_parameters) given a rope_scaling as a user extends the
    context: transformers runs the scaling, with the top-level theta or the default."""
    raw = {
        **BASE,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    }
    expected = _transformers_rope(raw, tmp_path)
    assert expected == {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    config = ModelConfig.from_dict(raw)
    assert (config.rope_theta, config.rope_scaling) == (
        10000.0,
        {"rope_type": "linear", "factor": 4.0},
    )
    with pytest.raises(ModelLoadError, match="unsupported rope scaling 'yarn'"):
        ModelConfig.from_dict({**raw, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ModelLoadError, match="rope_scaling must be an object, not 'linear'"):
        ModelConfig.from_dict({**raw, "rope_scaling": "linear"})
    alone = {k: v for k, v in raw.items() if k != "rope_scaling"}
    with pytest.raises(ModelLoadError, match="rope_parameters must be an object, not 'linear'"):
        ModelConfig.from_dict({**alone, "rope_parameters": "linear"})


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"rope_type": "linear"}, "linear rope scaling needs a positive number 'factor'"),
        ({"rope_type": "linear", "factor": "abc"}, "needs a positive number 'factor'"),
        ({"rope_type": "llama3", "factor": 8.0}, "needs a positive number 'low_freq_factor'"),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 64,
            },
            "low_freq_factor != high_freq_factor",
        ),
        ({"rope_type": "longrope", "short_factor": [1.0]}, "lists of numbers 'long_factor'"),
    ],
)
def test_a_rope_scaling_missing_its_numbers_is_a_load_error(
    scaling: dict[str, Any], message: str
) -> None:
    """Read only in the engine core, these raised a bare KeyError there, which a job took for
    an unsettled failure and kept, with a resume command that failed the same way."""
    raw = {
        **BASE,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 2,
        "rope_scaling": scaling,
    }
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        ModelConfig.from_dict(raw)


def test_gemma3_rope_scaling_beside_nested_rope_parameters_scales_the_global_layers(
    tmp_path: Path,
) -> None:
    raw = {
        **BASE,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "sliding_window": 512,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    expected = _transformers_rope(raw, tmp_path)
    assert expected["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    config = ModelConfig.from_dict(raw)
    assert (config.rope_theta, config.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert (config.sliding_rope_theta, config.sliding_rope_scaling) == (10000.0, None)


def test_gemma3_per_type_rope_parameters_without_thetas_take_the_top_level_ones(
    tmp_path: Path,
) -> None:
    """Before, the per-type dicts' missing thetas became 1e6 and 1e4 whatever rope_theta and
    rope_local_base_freq said, and every position rotated otherwise than in transformers."""
    raw = {
        **BASE,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 2,
        "sliding_window": 512,
        "sliding_window_pattern": 2,
        "rope_parameters": {
            "full_attention": {"rope_type": "default"},
            "sliding_attention": {"rope_type": "default"},
        },
        "rope_theta": 30.0,
        "rope_local_base_freq": 20.0,
    }
    expected = _transformers_rope(raw, tmp_path)
    config = ModelConfig.from_dict(raw)
    assert config.rope_theta == expected["full_attention"]["rope_theta"] == 30.0
    assert config.sliding_rope_theta == expected["sliding_attention"]["rope_theta"] == 20.0


def test_gemma3_local_layers_keep_their_rope_where_the_window_never_binds(
    tmp_path: Path, make_attention_metadata: Callable
) -> None:
    """A window as long as the context binds nowhere, but transformers still rotates the
    sliding_attention layers with their own base: so must vbatch."""
    from transformers import Gemma3TextConfig

    from benchmarks.tiny_model import build_tiny_model

    config = Gemma3TextConfig(
        **{**TINY_SHAPE, "num_hidden_layers": 3, "max_position_embeddings": 64},
        head_dim=16,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
    )
    reference = build_tiny_model(config)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    model = load(tmp_path, "torch")
    assert model.config.sliding_windows == ()
    assert [model.config.uses_sliding_rope(layer) for layer in range(3)] == [True, False, True]
    ids = [random.Random(3).randrange(VOCAB) for _ in range(40)]
    kv_caches = make_kv_caches(model.config, 16, 4)
    meta = make_attention_metadata([len(ids)], [len(ids)], [list(range(10))], 4)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), kv_caches, meta)
        got = model.compute_logits(hidden)
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)


def test_architectures_as_one_name_is_read_and_anything_else_refused() -> None:
    raw = {**BASE, "num_hidden_layers": 2}
    config = ModelConfig.from_dict({**raw, "architectures": "MistralForCausalLM"})
    assert config.architecture == "MistralForCausalLM"
    with pytest.raises(
        ModelLoadError, match=r"architectures must be a list of class names, not \[1\]"
    ):
        ModelConfig.from_dict({**raw, "architectures": [1]})


@pytest.mark.parametrize("heads", [{"num_attention_heads": 0}, {"num_key_value_heads": -1}])
def test_zero_or_negative_heads_are_a_model_load_error(heads: dict[str, int]) -> None:
    raw = {**BASE, "num_hidden_layers": 2, "architectures": ["LlamaForCausalLM"], **heads}
    with pytest.raises(ModelLoadError, match="bad attention shape"):
        ModelConfig.from_dict(raw)
