"""Config keys left out of config.json default per architecture as transformers' config classes
do (issue 24): every supported class's defaults, and tiny Gemma 2/3 models saved the 4.x way
(no key equal to its class default, so no `tie_word_embeddings`) against transformers."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from vbatch.models.hf_defaults import CONFIG_DEFAULTS
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams

MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def class_defaults(architecture: str) -> dict[str, Any]:
    from transformers import AutoConfig

    return AutoConfig.for_model(MODEL_TYPES[architecture]).to_dict()


def written_the_4x_way(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """`config` without the keys equal to its class's defaults, as transformers 4.x saved it."""
    defaults = class_defaults(architecture)
    kept = {"architectures", "model_type"}
    return {k: v for k, v in config.items() if k in kept or k not in defaults or defaults[k] != v}


def test_every_supported_architecture_has_a_table() -> None:
    assert set(MODEL_TYPES) == set(SUPPORTED_ARCHITECTURES) == set(CONFIG_DEFAULTS)


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_an_empty_config_reads_as_the_class_defaults(architecture: str) -> None:
    """A config.json naming only the architecture is the class's default model, key for key."""
    explicit = {**class_defaults(architecture), "architectures": [architecture]}
    assert ModelConfig.from_dict({"architectures": [architecture]}) == ModelConfig.from_dict(
        explicit
    )


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_saved_without_the_tie_key_matches_transformers(
    family: str, tiny_families: dict, tmp_path: Path, greedy_check: Callable
) -> None:
    reference, model_dir = tiny_families[family]
    shutil.copytree(model_dir, tmp_path, dirs_exist_ok=True)
    architecture = type(reference).__name__
    config = json.loads((model_dir / "config.json").read_text())
    stripped = written_the_4x_way(config, architecture)
    assert "tie_word_embeddings" not in stripped and "rms_norm_eps" not in stripped
    (tmp_path / "config.json").write_text(json.dumps(stripped))
    assert ModelConfig.from_hf_dir(tmp_path) == ModelConfig.from_hf_dir(model_dir)
    core = EngineCore(EngineConfig(model=str(tmp_path), attention_backend="torch", block_size=4))
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], [2, 71, 82, 81, 82]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens: dict[str, list[int]] = {"0": [], "1": []}
    for i, ids in enumerate(prompts):
        assert core.add_request(AddRequest(str(i), pack_token_ids(ids), params)) == []
    while core.has_unfinished():
        out = core.step()
        for request_id, token_id in zip(out.request_ids, out.token_ids, strict=True):
            tokens[request_id].append(token_id)
    core.shutdown()
    greedy_check(reference, prompts, [tokens["0"], tokens["1"]])
