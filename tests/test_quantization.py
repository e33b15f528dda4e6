from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vbatch.client.tokenizer import TextTokenizer
from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.errors import ConfigError
from vbatch.layers.attention import AttentionMetadata, TorchAttentionBackend
from vbatch.layers.quantization import Int8DynamicLinear, has_int8_kernels, quantize_linears
from vbatch.models.llama import load_model
from vbatch.models.loader import ResolvedModel
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not has_int8_kernels(), reason="no x86 int8 kernels in torch")


@pytest.mark.parametrize("has_bias", [False, True])
def test_int8_linear_tracks_float_linear(has_bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen)
    bias = torch.randn(96, generator=gen) if has_bias else None
    x = torch.randn(5, 7, 64, generator=gen)
    layer = Int8DynamicLinear(weight, bias)
    got = layer(x)
    expected = F.linear(x, weight, bias)
    assert got.shape == (5, 7, 96) and got.dtype == torch.float32
    assert (got - expected).abs().max() < 0.03 * expected.abs().max()
    assert not torch.equal(got, expected), "int8 rounding must show"


def test_quantize_linears_skips_the_lm_head() -> None:
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(8, 8))
    model.add_module("block", nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU()))
    model.add_module("lm_head", nn.Linear(8, 4, bias=False))
    assert quantize_linears(model) == 2
    assert isinstance(model.proj, Int8DynamicLinear)
    assert isinstance(model.block[0], Int8DynamicLinear)
    assert isinstance(model.lm_head, nn.Linear)


def test_quantization_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="quantization must be one of"):
        EngineConfig(quantization="int4").validate()
    with pytest.raises(ConfigError, match="CPU only"):
        EngineConfig(quantization="int8", device="cuda").validate()


def test_int8_needs_float32(smollm2: ResolvedModel) -> None:
    with pytest.raises(ConfigError, match="float32"):
        load_model(
            smollm2, torch.device("cpu"), torch.bfloat16, TorchAttentionBackend(), None, "int8"
        )


def _prefill_logits(
    model: nn.Module, ids: list[int], meta: AttentionMetadata, block_size: int
) -> torch.Tensor:
    config = model.config
    shape = (-(-len(ids) // block_size), block_size, config.num_key_value_heads, config.head_dim)
    kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), kv_caches, meta)
        return model.compute_logits(hidden)


TEXTS = [
    "The history of bridges is a testament to human ingenuity. Early bridges were logs and "
    "stones laid across streams; over centuries engineers learned to build arches, trusses and "
    "suspension spans that carry heavy loads across wide rivers and deep valleys.",
    "Bees make honey by collecting nectar from flowers. Back in the hive, worker bees pass the "
    "nectar to each other, adding enzymes, and fan it with their wings until most of the water "
    "evaporates.",
]


def test_int8_smollm2_keeps_its_predictions(
    smollm2: ResolvedModel, tokenizer: TextTokenizer, make_attention_metadata: Callable
) -> None:
    """Teacher-forced next-token predictions on real text: int8 agrees with fp32 at most
    positions, and its log-likelihood of the text stays close (measured: 93% and <0.1 nats)."""
    cpu = torch.device("cpu")
    fp32 = load_model(smollm2, cpu, torch.float32, TorchAttentionBackend())
    int8 = load_model(smollm2, cpu, torch.float32, TorchAttentionBackend(), None, "int8")
    assert isinstance(int8.layers[0].mlp.down_proj, Int8DynamicLinear)
    for ids in tokenizer.encode_batch(TEXTS):
        table = list(range(-(-len(ids) // 16)))
        meta = make_attention_metadata([len(ids)], [len(ids)], [table], 16)
        ref = _prefill_logits(fp32, ids, meta, 16)
        got = _prefill_logits(int8, ids, meta, 16)
        assert (ref.argmax(-1) == got.argmax(-1)).float().mean() > 0.85
        target = torch.tensor(ids[1:])
        ref_lp = ref[:-1].log_softmax(-1).gather(1, target[:, None]).mean()
        got_lp = got[:-1].log_softmax(-1).gather(1, target[:, None]).mean()
        assert abs(float(ref_lp - got_lp)) < 0.15


def test_engine_core_runs_int8(tiny_model_dir: Path) -> None:
    core = EngineCore(
        EngineConfig(model=str(tiny_model_dir), device="cpu", quantization="int8", num_kv_blocks=64)
    )
    assert isinstance(core.runner.model.layers[0].self_attn.qkv_proj, Int8DynamicLinear)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    core.add_request(AddRequest("a", pack_token_ids([5, 6, 7, 8]), params))
    tokens: list[int] = []
    while core.has_unfinished():
        tokens.extend(core.step().token_ids)
    assert len(tokens) == 6
