"""The core's pooling steps (engine/pooling.py) in process: jobs packed into steps beside
generation, blocks held only during a step, the prefix cache left as it was, aborts, errors; and
the sentence-transformers pooling config (models/poolers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest

from benchmarks.tiny_pooling import write_sentence_transformers_files
from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.errors import ModelLoadError, SamplingParamsError
from vbatch.models.poolers import PoolingConfig, read_pooling_config
from vbatch.pooling_params import PoolingParams, PoolingTask
from vbatch.protocol import AddRequest, FinishReason, pack_token_ids
from vbatch.sampling_params import SamplingParams

PREFILL_ONLY = SamplingParams(max_tokens=1)


def test_pooling_steps_pack_jobs_beside_generation_and_give_their_blocks_back(
    tiny_model_dir: Path,
) -> None:
    core = EngineCore(
        EngineConfig(model=str(tiny_model_dir), max_num_batched_tokens=64, num_threads=1)
    )
    manager = core.scheduler.block_manager
    num_free = manager.num_free_blocks
    generate = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    core.add_request(AddRequest("gen", pack_token_ids(list(range(10, 50))), generate))
    embed = PoolingParams(PoolingTask.EMBED)
    for i in range(6):
        ids = pack_token_ids(list(range(100 + i, 120 + i)))
        assert core.add_request(AddRequest(f"e{i}", ids, PREFILL_ONLY, pooling=embed)) == []
    long_ids = pack_token_ids(list(range(1, 201)))
    assert core.add_request(AddRequest("long", long_ids, PREFILL_ONLY, pooling=embed)) == []
    core.add_request(AddRequest("gone", pack_token_ids([5, 6]), PREFILL_ONLY, pooling=embed))
    (aborted,) = core.abort(["gone"])
    assert aborted.finish_reason == FinishReason.ABORT
    classify = PoolingParams(PoolingTask.CLASSIFY)
    (refused,) = core.add_request(
        AddRequest("c", pack_token_ids([5]), PREFILL_ONLY, pooling=classify)
    )
    assert (
        refused.finish_reason == FinishReason.ERROR and "ForSequenceClassification" in refused.error
    )
    pooled, finished, num_pooling_steps = {}, {}, 0
    while core.has_unfinished():
        out = core.step()
        num_pooling_steps += bool(out.pooled)
        pooled.update({p.request_id: p for p in out.pooled})
        finished.update({f.request_id: f for f in out.finished})
        # NOTE: between steps only generation holds blocks.
        held = sum(len(seq.block_table) for seq in core.scheduler.running)
        assert manager.num_free_blocks == num_free - held
    assert set(pooled) == {f"e{i}" for i in range(6)} | {"long"}
    assert all(finished[rid].finish_reason == FinishReason.STOP for rid in pooled)
    # NOTE: 3 of the 20-token jobs fit a 64-token step; the 200-token one runs alone.
    assert num_pooling_steps == 3
    assert np.frombuffer(pooled["long"].data, "<f4").shape == (64,)
    assert manager.num_free_blocks == num_free
    # NOTE: the generated prompt's blocks are cached; no pooled prompt's block is.
    assert manager.num_cached_blocks == 40 // core.config.block_size


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_a_prompt_scored_for_prompt_logprobs_is_not_computed_again(
    tiny_model_dir: Path, enable_prefix_caching: bool
) -> None:
    core = EngineCore(
        EngineConfig(
            model=str(tiny_model_dir),
            num_threads=1,
            enable_prefix_caching=enable_prefix_caching,
        )
    )
    manager = core.scheduler.block_manager
    prompt = list(range(10, 60))
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    core.add_request(AddRequest("gen", pack_token_ids(prompt), params))
    (seq,) = core.requests["gen"]
    finished = []
    while core.has_unfinished():
        finished.extend(core.step().finished)
    assert [f.finish_reason for f in finished] == [FinishReason.LENGTH]
    full_blocks = (len(prompt) - 1) // core.config.block_size * core.config.block_size
    # NOTE: the prefill after the prompt-logprob pass computes only what the cache lacks.
    hits = full_blocks if enable_prefix_caching else 0
    assert seq.num_cached_tokens == manager.num_prefix_hits == hits


def _generate(core: EngineCore, prompt: list[int], params: SamplingParams) -> list[float]:
    core.add_request(AddRequest("gen", pack_token_ids(prompt), params))
    logprobs = []
    while core.has_unfinished():
        out = core.step()
        logprobs.extend(entry.logprob for entry in out.logprobs or [] if entry is not None)
    return logprobs


def test_blocks_cached_by_a_prompt_logprob_pass_hold_the_bits_of_a_cold_prefill(
    tiny_model_dir: Path,
) -> None:
    config = EngineConfig(model=str(tiny_model_dir), num_threads=1, attention_backend="native")
    prompt = list(range(10, 70))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    cold = _generate(EngineCore(config), prompt, params)
    core = EngineCore(config)
    scored = msgspec.structs.replace(params, prompt_logprobs=0)
    after_pass = _generate(core, prompt, scored)
    assert core.scheduler.block_manager.num_prefix_hits > 0
    assert after_pass == cold


def test_pooling_params_are_checked() -> None:
    with pytest.raises(SamplingParamsError, match="dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(SamplingParamsError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=-2)
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=True)


def test_pooling_config_follows_the_sentence_transformers_files(tmp_path: Path) -> None:
    assert read_pooling_config(tmp_path, "cls") == PoolingConfig("cls", True)
    write_sentence_transformers_files(tmp_path, "mean", normalize=False)
    assert read_pooling_config(tmp_path, "cls") == PoolingConfig("mean", False, 512)
    for bad in ('{"max_seq_length": "512"}', '{"do_lower_case": "yes"}', "[]"):
        (tmp_path / "sentence_bert_config.json").write_text(bad)
        with pytest.raises(ModelLoadError, match=r"sentence_bert_config\.json"):
            read_pooling_config(tmp_path, "cls")
    write_sentence_transformers_files(tmp_path, "mean", normalize=False)
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 3, "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match="Dense"):
        read_pooling_config(tmp_path, "cls")
    # NOTE: these raised AttributeError in every row; {} dropped the Normalize module unsaid.
    for bad in ("[1, 2]", '{"a": 1}', "{}", '[{"path": 5}]'):
        (tmp_path / "modules.json").write_text(bad)
        with pytest.raises(ModelLoadError, match=r"modules\.json is not a list of modules"):
            read_pooling_config(tmp_path, "cls")
    write_sentence_transformers_files(tmp_path, "mean", normalize=False)
    (tmp_path / "1_Pooling" / "config.json").write_text("[1]")
    with pytest.raises(ModelLoadError, match="is not an object of pooling_mode_"):
        read_pooling_config(tmp_path, "cls")


def test_pooling_config_refuses_modes_it_would_drop_and_reads_sentence_transformers_6(
    tmp_path: Path,
) -> None:
    """mean with mean_sqrt_len (or weightedmean) is a concatenation in sentence-transformers:
    the second mode was dropped, and the embedding had half its width. sentence-transformers 6
    saves its modules under new paths and the mode as one string."""
    write_sentence_transformers_files(tmp_path, "mean", normalize=True)
    config_path = tmp_path / "1_Pooling" / "config.json"
    config = json.loads(config_path.read_text())
    for extra in ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens"):
        config_path.write_text(json.dumps({**config, extra: True}))
        with pytest.raises(ModelLoadError, match=extra):
            read_pooling_config(tmp_path, "cls")
    modules = [
        {
            "idx": 0,
            "path": "",
            "type": "sentence_transformers.base.modules.transformer.Transformer",
        },
        {
            "idx": 1,
            "path": "1_Pooling",
            "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
        },
        {
            "idx": 2,
            "path": "2_Normalize",
            "type": "sentence_transformers.base.modules.normalize.Normalize",
        },
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    config_path.write_text(json.dumps({"pooling_mode": "max", "include_prompt": True}))
    assert read_pooling_config(tmp_path, "cls").mode == "max"
    assert read_pooling_config(tmp_path, "cls").normalize
    config_path.write_text(json.dumps({"pooling_mode": "weightedmean"}))
    with pytest.raises(ModelLoadError, match="weightedmean"):
        read_pooling_config(tmp_path, "cls")
