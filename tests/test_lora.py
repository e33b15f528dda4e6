"""LoRA adapters against PEFT (PeftModel over the transformers model, unmerged) on tiny random
models: Llama, Qwen3 and Phi-3 (fused qkv_proj / gate_up_proj in its checkpoint), three
adapters of different ranks, targets and scalings mixed with the base model in one batch, with
chunked prefill, preemption and prompts sharing a prefix across adapters; and the adapter
checks, the slots' LRU and the Python API."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.tiny_model import TINY_SHAPE, build_tiny_family
from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.errors import ConfigError, LoraError
from vbatch.lora.adapter import read_adapter_config
from vbatch.lora.request import LoraRef, LoRARequest
from vbatch.protocol import AddRequest, FinishReason, pack_token_ids
from vbatch.sampling_params import SamplingParams

VOCAB = TINY_SHAPE["vocab_size"]
UNFUSED = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_GAIN = 4.0
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def adapter_specs(fused: bool) -> list[dict[str, Any]]:
    """Three adapters: rank 4 on q and v, rank 8 rsLoRA on everything, rank 16 on o/up/down."""
    return [
        dict(r=4, lora_alpha=8, target_modules=["qkv_proj"] if fused else ["q_proj", "v_proj"]),
        dict(r=8, lora_alpha=16, use_rslora=True, target_modules=FUSED if fused else UNFUSED),
        dict(
            r=16,
            lora_alpha=4,
            target_modules=["o_proj", "down_proj"] + ([] if fused else ["up_proj"]),
        ),
    ]


def build_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_SHAPE)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "embed" not in name:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    return model


def write_adapters(reference: Any, root: Path, fused: bool) -> list[Any]:
    """Save three random non-zero PEFT adapters over `reference` into root/a0..a2; returns the
    PeftModels (each over its own copy of the model)."""
    from peft import LoraConfig, get_peft_model

    models = []
    for i, spec in enumerate(adapter_specs(fused)):
        torch.manual_seed(10 + i)
        config = LoraConfig(init_lora_weights=False, **spec)
        peft_model = get_peft_model(copy.deepcopy(reference), config).eval()
        with torch.no_grad():
            # NOTE: strong enough to change the tiny models' greedy tokens.
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.mul_(ADAPTER_GAIN)
        peft_model.save_pretrained(root / f"a{i}")
        models.append(peft_model)
    return models


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path, list]]:
    """family → (transformers model, model dir, PeftModels of adapters a0..a2 saved beside)."""
    root = tmp_path_factory.mktemp("lora")
    models = {}
    for family in ("llama", "qwen3", "phi3-longrope"):
        reference = build_llama() if family == "llama" else build_tiny_family(family)
        reference.save_pretrained(root / family / "model", safe_serialization=True)
        peft = write_adapters(reference, root / family, fused=family.startswith("phi3"))
        models[family] = (reference, root / family, peft)
    return models


def mixed_prompts() -> tuple[list[list[int]], list[int | None]]:
    """Ten prompts sharing a 12-token prefix (three 4-token blocks), and each one's adapter
    (None: the base model), every adapter on at least two prompts."""
    rng = random.Random(5)
    prefix = [rng.randrange(VOCAB) for _ in range(12)]
    lengths = (5, 11, 3, 9, 7, 13, 4, 6, 10, 2)
    prompts = [prefix + [rng.randrange(VOCAB) for _ in range(n)] for n in lengths]
    return prompts, [None, 0, 1, 2, 0, 1, 2, None, 1, 0]


def run_core(core: EngineCore, prompts: list[list[int]], refs: list[LoraRef | None]) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, (ids, ref) in enumerate(zip(prompts, refs, strict=True)):
        added = core.add_request(AddRequest(f"r{i}", pack_token_ids(ids), params, lora=ref))
        assert added == []
    while core.has_unfinished():
        out = core.step()
        assert not [f for f in out.finished if f.finish_reason == FinishReason.ERROR]
        for request_id, token_id in zip(out.request_ids, out.token_ids, strict=True):
            tokens[request_id].append(token_id)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3-longrope"])
def test_mixed_adapters_match_peft(family: str, lora_models: dict, greedy_check: Callable) -> None:
    """Three adapters and the base model in one batch, two adapter slots (so adapters are
    evicted and reloaded), 8-token chunked prefill over 4-token blocks, a pool small enough to
    preempt, and a shared prefix that each adapter must compute for itself."""
    reference, root, peft_models = lora_models[family]
    config = EngineConfig(
        model=str(root / "model"),
        attention_backend="torch",
        block_size=4,
        max_num_batched_tokens=8,
        num_kv_blocks=18,
        max_num_seqs=4,
        enable_lora=True,
        max_loras=2,
    )
    core = EngineCore(config)
    prompts, adapters = mixed_prompts()
    refs = [None if a is None else LoraRef(a + 1, f"a{a}", str(root / f"a{a}")) for a in adapters]
    got = run_core(core, prompts, refs)
    assert core.scheduler.num_preemptions > 0
    assert core.scheduler.block_manager.num_prefix_hits > 0
    for ids, tokens, adapter in zip(prompts, got, adapters, strict=True):
        greedy_check(reference if adapter is None else peft_models[adapter], [ids], [tokens])
    base = [tokens for tokens, adapter in zip(got, adapters, strict=True) if adapter is None]
    # NOTE: the adapters matter: several adapted prompts decode otherwise than the base model.
    with_adapter = run_core(EngineCore(config), prompts, [None] * len(prompts))
    assert base == [t for t, a in zip(with_adapter, adapters, strict=True) if a is None]
    changed = [
        ours != plain
        for ours, plain, a in zip(got, with_adapter, adapters, strict=True)
        if a is not None
    ]
    assert sum(changed) >= 3


@pytest.mark.gpu
def test_mixed_adapters_match_peft_on_cuda(lora_models: dict, greedy_check: Callable) -> None:
    """The CUDA path (eager, float32): the same mix of adapters as on CPU."""
    reference, root, peft_models = lora_models["llama"]
    config = EngineConfig(
        model=str(root / "model"),
        device="cuda",
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=8,
        num_kv_blocks=18,
        max_num_seqs=4,
        enable_lora=True,
        max_loras=2,
    )
    prompts, adapters = mixed_prompts()
    refs = [None if a is None else LoraRef(a + 1, f"a{a}", str(root / f"a{a}")) for a in adapters]
    got = run_core(EngineCore(config), prompts, refs)
    for ids, tokens, adapter in zip(prompts, got, adapters, strict=True):
        greedy_check(reference if adapter is None else peft_models[adapter], [ids], [tokens])


def test_prefix_cache_is_per_adapter(lora_models: dict) -> None:
    """The same prompt under two adapters shares no cached block; under one it does."""
    _, root, _ = lora_models["llama"]
    config = EngineConfig(
        model=str(root / "model"), attention_backend="torch", block_size=4, enable_lora=True
    )
    core = EngineCore(config)
    prompt = list(range(1, 18))
    a0 = LoraRef(1, "a0", str(root / "a0"))
    a1 = LoraRef(2, "a1", str(root / "a1"))
    for refs in ([a0], [a1], [None], [a0]):
        run_core(core, [prompt], refs)
    assert core.scheduler.block_manager.num_prefix_hits == 16


def test_slots_lru_and_scheduler_limit(lora_models: dict) -> None:
    """With one slot, three adapters never share a step, and each is loaded again after being
    evicted; every request still finishes."""
    _, root, _ = lora_models["llama"]
    config = EngineConfig(
        model=str(root / "model"), attention_backend="torch", enable_lora=True, max_loras=1
    )
    core = EngineCore(config)
    slots = core.runner.lora
    assert slots is not None
    step_adapters: list[set[int]] = []
    prepare = slots.prepare

    def observe(out: Any) -> None:
        step_adapters.append({seq.lora_id for seq in out.seqs} - {0})
        prepare(out)

    slots.prepare = observe  # type: ignore[method-assign]
    refs = [LoraRef(i % 3 + 1, f"a{i % 3}", str(root / f"a{i % 3}")) for i in range(6)]
    got = run_core(core, [[5, 6, 7, i] for i in range(6)], refs)
    assert all(len(tokens) == 8 for tokens in got)
    assert max(len(adapters) for adapters in step_adapters) == 1
    runs = [next(iter(a)) for a in step_adapters if a]
    assert len({r for r, prev in zip(runs[1:], runs, strict=False) if r != prev}) >= 2
    assert len(slots.slot_of) == 1


def write_variant(
    root: Path, name: str, edit_config: dict, edit_tensors: Callable | None = None
) -> Path:
    """A copy of adapter a0 with its config fields replaced and its tensors edited."""
    out = root / name
    out.mkdir()
    config = json.loads((root / "a0" / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, **edit_config}))
    tensors = load_file(root / "a0" / "adapter_model.safetensors")
    save_file(edit_tensors(tensors) if edit_tensors else tensors, out / "adapter_model.safetensors")
    return out


def test_bad_adapters_fail_at_start_naming_them(lora_models: dict, tmp_path: Path) -> None:
    _, root, _ = lora_models["llama"]
    for name in ("a0",):
        (tmp_path / name).symlink_to(root / name)
    cases = {
        "dora": ({"use_dora": True}, None, "DoRA"),
        "experts": (
            {"target_parameters": ["mlp.experts.gate_up_proj"], "alpha_pattern": {"x": 2}},
            None,
            r"target_parameters \['mlp.experts.gate_up_proj'\] \(adapters on parameters",
        ),
        "tokens": ({"trainable_token_indices": [5, 6]}, None, "trainable_token_indices"),
        "big": ({"r": 128}, None, "above max_lora_rank 64"),
        "embed": (
            {},
            lambda t: {
                **t,
                "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 256),
            },
            "not a LoRA A/B",
        ),
        "head": (
            {},
            lambda t: {
                **t,
                "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
                "base_model.model.lm_head.lora_B.weight": torch.zeros(256, 4),
            },
            "lm_head",
        ),
        "other": (
            {},
            lambda t: {
                k: torch.zeros(v.shape[0], 32) if "lora_A" in k else v for k, v in t.items()
            },
            "made for another base model",
        ),
        "short-b": (
            {},
            lambda t: {k: v[:16] if "v_proj.lora_B" in k else v for k, v in t.items()},
            "B has 16 rows where this model's v_proj has 32",
        ),
        "untargeted": ({"target_modules": ["k_proj"]}, None, r"target_modules \['k_proj'\]"),
        "rank": ({"r": 8}, None, "has rank 4, but adapter_config.json gives it r = 8"),
        "pattern": ({"rank_pattern": {"v_proj": 2}}, None, "v_proj has rank 4, but .* r = 2"),
    }
    for name, (config_edit, tensor_edit, message) in [
        *cases.items(),
        ("corrupt", ({}, None, "cannot read adapter_model.safetensors: .*header")),
    ]:
        path = write_variant(tmp_path, name, config_edit, tensor_edit)
        if name == "corrupt":
            (path / "adapter_model.safetensors").write_bytes(b"\x01")
        config = EngineConfig(
            model=str(root / "model"),
            enable_lora=True,
            loras=(("ok", str(root / "a1")), (name, str(path))),
        )
        with pytest.raises(LoraError, match=message) as error:
            EngineCore(config)
        assert f"'{name}'" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="enable_lora"):
        EngineConfig(model="x", loras=(("a", "b"),)).validate()


def test_rank_pattern_and_regex_targets_are_read_as_peft_reads_them(
    lora_models: dict, tmp_path: Path
) -> None:
    _, root, _ = lora_models["llama"]
    (tmp_path / "a0").symlink_to(root / "a0")
    edits = {
        "pattern": {"r": 16, "rank_pattern": {"q_proj": 4, "v_proj": 4}},
        "regex": {"target_modules": r".*\.(q|v)_proj"},
    }
    for name, edit in edits.items():
        path = write_variant(tmp_path, name, edit)
        config = EngineConfig(
            model=str(root / "model"), enable_lora=True, loras=((name, str(path)),)
        )
        EngineCore(config)


def test_unknown_adapter_is_a_request_error(lora_models: dict, tmp_path: Path) -> None:
    _, root, _ = lora_models["llama"]
    core = EngineCore(EngineConfig(model=str(root / "model"), enable_lora=True))
    params = SamplingParams(max_tokens=2)
    finish = core.add_request(
        AddRequest("r", pack_token_ids([1, 2]), params, lora=LoraRef(1, "x", str(tmp_path)))
    )
    assert finish[0].finish_reason == FinishReason.ERROR and "'x'" in (finish[0].error or "")
    plain = EngineCore(EngineConfig(model=str(root / "model")))
    finish = plain.add_request(
        AddRequest("r", pack_token_ids([1, 2]), params, lora=LoraRef(1, "a0", str(root / "a0")))
    )
    assert "enable_lora" in (finish[0].error or "")


def test_read_adapter_config(lora_models: dict) -> None:
    _, root, _ = lora_models["llama"]
    config = read_adapter_config("a1", root / "a1", 64)
    assert (
        config.rank == 8 and config.use_rslora and config.scaling(8) == pytest.approx(16 / 8**0.5)
    )
    with pytest.raises(LoraError, match="above max_lora_rank 4"):
        read_adapter_config("a1", root / "a1", 4)


def test_target_modules_as_dotted_paths_name_their_last_part(tmp_path: Path) -> None:
    """PEFT writes "all-linear" out as full module paths, and matches a list entry by its
    suffix: "model.layers.0.self_attn.q_proj" is a q_proj."""
    base = {"r": 4, "lora_alpha": 8, "peft_type": "LORA"}
    paths = [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "mlp.up_proj")]
    (tmp_path / "adapter_config.json").write_text(json.dumps({**base, "target_modules": paths}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    assert read_adapter_config("x", tmp_path, 64).rank == 4
    router = {**base, "target_modules": ["self_attn.q_proj", "model.layers.0.mlp.router"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(router))
    with pytest.raises(LoraError, match=r"targets model\.layers\.0\.mlp\.router; vbatch"):
        read_adapter_config("x", tmp_path, 64)


@pytest.fixture(scope="module")
def text_lora_model(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Path, list]:
    """The tiny Llama with SmolLM2's tokenizer (for text prompts), adapters a0..a2 beside it."""
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("text-lora")
    return reference, root, write_adapters(reference, root, fused=False)


def test_llm_generate_with_lora_requests(
    text_lora_model: tuple, tiny_model_dir: Path, greedy_check: Callable
) -> None:
    """vLLM's API: LLM(enable_lora=True), generate(..., lora_request=one or a list)."""
    from vbatch import LLM
    from vbatch import LoRARequest as TopLevel

    assert TopLevel is LoRARequest
    reference, root, peft_models = text_lora_model
    prompts = ["The capital of France is", "Once upon a time", "def main():", "1, 2, 3,"]
    adapters = [None, 0, 1, 2]
    requests = [
        None if a is None else LoRARequest(f"a{a}", a + 1, str(root / f"a{a}")) for a in adapters
    ]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(tiny_model_dir), enable_lora=True, max_loras=2, num_threads=1) as llm:
        outs = llm.generate(prompts, params, lora_request=requests)
        for out, a in zip(outs, adapters, strict=True):
            assert out.error is None
            model = reference if a is None else peft_models[a]
            greedy_check(model, [out.prompt_token_ids], [out.outputs[0].token_ids])
        one = llm.generate(prompts[:2], params, lora_request=requests[3])
        for out in one:
            greedy_check(peft_models[2], [out.prompt_token_ids], [out.outputs[0].token_ids])
        bad = llm.generate(prompts[0], params, lora_request=LoRARequest("zz", 9, str(root)))
        assert "'zz'" in (bad[0].error or "")
        with pytest.raises(ValueError, match="one per prompt"):
            llm.generate(prompts, params, lora_request=requests[:2])


def test_wider_adapter_registered_mid_decode(lora_models: dict, greedy_check: Callable) -> None:
    """Registering a higher-rank adapter widens (and clears) every slot; the running seq's
    continuing decode steps then load their adapter again."""
    _, root, peft_models = lora_models["llama"]
    config = EngineConfig(
        model=str(root / "model"), attention_backend="torch", enable_lora=True, max_num_seqs=1
    )
    core = EngineCore(config)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    a0, a2 = (LoraRef(i + 1, f"a{i}", str(root / f"a{i}")) for i in (0, 2))
    core.add_request(AddRequest("r0", pack_token_ids(prompt), params, lora=a0))
    tokens: list[int] = []
    for _ in range(3):
        tokens += core.step().token_ids
    core.add_request(AddRequest("r1", pack_token_ids(prompt), params, lora=a2))
    while len(tokens) < 8:
        out = core.step()
        tokens += [t for r, t in zip(out.request_ids, out.token_ids, strict=True) if r == "r0"]
    greedy_check(peft_models[0], [prompt], [tokens])


def test_scheduler_admits_past_a_seq_whose_adapter_has_no_slot() -> None:
    """One slot: a seq of another adapter waits, and seqs behind it of the running adapter or
    the base model go first; it runs once the running adapter's seqs are done."""
    from vbatch.engine.scheduler import Scheduler, SchedulerConfig
    from vbatch.engine.sequence import Sequence

    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=64,
        max_loras=1,
    )
    scheduler = Scheduler(config, eos_token_ids=[])
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    seqs = [Sequence(f"r{i}", [1, 2, 3], params, 0, lora) for i, lora in enumerate((1, 2, 1, 0))]
    for seq in seqs:
        scheduler.add(seq)
    first = scheduler.schedule()
    assert [seq.request_id for seq in first.seqs] == ["r0", "r2", "r3"]
    scheduler.update(first, [7, 7, 7])
    second = scheduler.schedule()
    assert [seq.request_id for seq in second.seqs] == ["r1"]


@pytest.mark.parametrize("lora_int_id", [0, -3, True, 1.5])
def test_a_lora_request_needs_a_positive_int_id(lora_int_id: object) -> None:
    """As vLLM: an id below 1 names no adapter (it ran the adapter before)."""
    with pytest.raises(ValueError, match="lora_int_id must be an int > 0"):
        LoRARequest("a", lora_int_id, "/adapter")  # type: ignore[arg-type]
    assert LoRARequest("a", 1, "/adapter").lora_int_id == 1
