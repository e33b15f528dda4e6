"""Tests for DecodeGraphRunner: buckets, padding rows, static buffers; real graphs on CUDA."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from vbatch.config import EngineConfig
from vbatch.engine.cuda_graphs import DecodeGraphRunner, graph_batch_sizes
from vbatch.engine.model_runner import ModelRunner, StepInputs
from vbatch.engine.sequence import Sequence
from vbatch.engine.steps import SchedulerOutput
from vbatch.models.config import ModelConfig
from vbatch.models.loader import resolve_model
from vbatch.sampling_params import SamplingParams

BLOCK_SIZE = 4
MAX_BLOCKS_PER_SEQ = 8
PROMPTS = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18], [19], [20, 21, 22]]


def make_runner(
    model_dir: Path, backend: str, device: str = "cpu", **config: object
) -> ModelRunner:
    engine_config = EngineConfig(
        model=str(model_dir),
        device=device,
        block_size=BLOCK_SIZE,
        num_kv_blocks=32,
        attention_backend=backend,
        **config,  # type: ignore[arg-type]
    ).validate()
    resolved = resolve_model(engine_config.model)
    return ModelRunner(engine_config, resolved, ModelConfig.from_hf_dir(resolved.hf_dir))


def static_runner(runner: ModelRunner, max_batch_size: int = 4) -> DecodeGraphRunner:
    return DecodeGraphRunner(
        runner.model,
        runner.kv_caches,
        runner.model_config.vocab_size,
        max_batch_size=max_batch_size,
        max_num_blocks_per_seq=MAX_BLOCKS_PER_SEQ,
        pad_block=runner.pad_block,
        use_graphs=False,
    )


def prefilled_seqs(runner: ModelRunner) -> list[Sequence]:
    """PROMPTS prefilled greedily, each in its own blocks with room for a few decodes."""
    seqs = []
    for i, prompt in enumerate(PROMPTS):
        seq = Sequence(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=8))
        seq.block_table.extend(range(4 * i, 4 * i + 4))
        seqs.append(seq)
    token_ids, _ = runner.execute(
        SchedulerOutput(seqs=seqs, num_new_tokens=[len(p) for p in PROMPTS])
    )
    for seq, token_id in zip(seqs, token_ids, strict=True):
        seq.num_computed_tokens = seq.num_tokens
        seq.append_token(token_id)
    return seqs


def decode_inputs(runner: ModelRunner, seqs: list[Sequence]) -> StepInputs:
    return runner.prepare(SchedulerOutput(seqs=seqs, num_new_tokens=[1] * len(seqs)))


@torch.inference_mode()
def eager_logits(runner: ModelRunner, inputs: StepInputs) -> torch.Tensor:
    hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
    return runner.model.compute_logits(hidden.index_select(0, inputs.logits_rows)).clone()


@torch.inference_mode()
def static_logits(graphs: DecodeGraphRunner, inputs: StepInputs) -> torch.Tensor:
    logits = graphs.run(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_rows)
    return logits.clone()


def advance(seqs: list[Sequence], token_ids: list[int]) -> None:
    for seq, token_id in zip(seqs, token_ids, strict=True):
        seq.num_computed_tokens = seq.num_tokens
        seq.append_token(token_id)


def test_buckets_cover_every_batch_size() -> None:
    assert graph_batch_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert graph_batch_sizes(100)[-3:] == [88, 96, 100]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(1) == [1]


def test_cpu_runner_stays_eager_with_a_pad_block(tiny_model_dir: Path) -> None:
    runner = make_runner(tiny_model_dir, "native")
    assert runner.graph_runner is None
    assert runner.pad_block == runner.num_kv_blocks == 32
    assert runner.kv_caches[0][0].shape[0] == runner.num_kv_blocks + 1
    graphs = static_runner(runner)
    assert [graphs.bucket(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_padded_static_decode_matches_eager(tiny_model_dir: Path, backend: str) -> None:
    runner = make_runner(tiny_model_dir, backend)
    assert runner.attn_backend.name == backend
    graphs = static_runner(runner)
    seqs = prefilled_seqs(runner)
    # NOTE: 3 seqs pad to 4; then 1 turns the rows it leaves into padding; then 2 and 3 again.
    for batch in ([0, 1, 2], [1], [2, 0], [0, 1, 2], [2, 1, 0]):
        step_seqs = [seqs[i] for i in batch]
        inputs = decode_inputs(runner, step_seqs)
        expected = eager_logits(runner, inputs)
        logits = static_logits(graphs, inputs)
        assert logits.shape == expected.shape == (len(batch), runner.model_config.vocab_size)
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        token_ids = logits.argmax(dim=-1).tolist()
        assert token_ids == expected.argmax(dim=-1).tolist()
        advance(step_seqs, token_ids)


def changed_slots(k_cache: torch.Tensor, before: torch.Tensor) -> list[int]:
    return (k_cache != before).flatten(1).any(dim=1).nonzero().flatten().tolist()


def test_padding_rows_write_only_the_pad_block(tiny_model_dir: Path) -> None:
    runner = make_runner(tiny_model_dir, "torch")  # NOTE: a zeroed cache shows every write
    graphs = static_runner(runner, max_batch_size=8)
    seqs = prefilled_seqs(runner)
    k_cache = runner.kv_caches[0][0].flatten(0, 1)  # [num_slots, num_kv_heads, head_dim]
    inputs = decode_inputs(runner, seqs)  # 5 seqs in bucket 8: rows 5-7 are padding
    before = k_cache.clone()
    static_logits(graphs, inputs)
    slots = inputs.meta.slot_mapping.tolist()
    assert changed_slots(k_cache, before) == sorted([*slots, graphs.pad_slot])
    advance(seqs, [1, 2, 3, 4, 5])
    # NOTE: seq 3's block goes to another seq; row 3, stale, must not write its slot again.
    k_cache[slots[3]] = 0.0
    inputs = decode_inputs(runner, seqs[:3])  # bucket 4: row 3 is padding now
    before = k_cache.clone()
    static_logits(graphs, inputs)
    assert changed_slots(k_cache, before) == sorted(inputs.meta.slot_mapping.tolist())
    assert not k_cache[slots[3]].any()


def test_stale_logits_rows_stay_inside_a_smaller_bucket(tiny_model_dir: Path) -> None:
    runner = make_runner(tiny_model_dir, "native")
    graphs = static_runner(runner, max_batch_size=8)
    seqs = prefilled_seqs(runner)
    inputs = decode_inputs(runner, seqs)  # bucket 8
    with torch.inference_mode():
        graphs.run(inputs.input_ids, inputs.positions, inputs.meta, torch.tensor([4, 4, 4, 4]))
    advance(seqs, [1, 2, 3, 4, 5])
    inputs = decode_inputs(runner, seqs[:3])  # bucket 4: row 4 does not exist there
    inputs = dataclasses.replace(inputs, logits_rows=inputs.logits_rows[2:])
    expected = eager_logits(runner, inputs)
    torch.testing.assert_close(static_logits(graphs, inputs), expected, rtol=1e-5, atol=1e-5)


def test_only_decode_steps_that_fit_can_run(tiny_model_dir: Path) -> None:
    runner = make_runner(tiny_model_dir, "native")
    graphs = static_runner(runner, max_batch_size=2)
    seqs = prefilled_seqs(runner)
    assert graphs.can_run(decode_inputs(runner, seqs[:2]).meta)
    assert not graphs.can_run(decode_inputs(runner, seqs).meta)  # 3 seqs > 2
    prefill = Sequence("p", [1, 2, 3], SamplingParams())
    prefill.block_table.append(20)
    assert not graphs.can_run(
        runner.prepare(SchedulerOutput(seqs=[prefill], num_new_tokens=[3])).meta
    )
    long_seq = Sequence("l", list(range(40)), SamplingParams())
    long_seq.num_computed_tokens = 39
    long_seq.block_table.extend(range(10))  # 10 blocks > MAX_BLOCKS_PER_SEQ
    assert not graphs.can_run(decode_inputs(runner, [long_seq]).meta)


# NOTE: float32 on CUDA too: bf16 logits tie often enough to flip a token between batch shapes.
@pytest.mark.gpu
@torch.inference_mode()
def test_cuda_graph_replay_matches_eager(tiny_model_dir: Path) -> None:
    """Under inference mode, as the engine runs: the runner's pinned staging buffers are
    inference tensors, which cannot be written outside it."""
    runner = make_runner(
        tiny_model_dir, "native", device="cuda", dtype="float32", max_graph_batch_size=8
    )
    graphs = runner.graph_runner
    assert graphs is not None and sorted(graphs._graphs) == [1, 2, 4, 8]
    same_shapes = static_runner(runner, max_batch_size=8)
    seqs = prefilled_seqs(runner)
    for batch in ([0, 1, 2], [1], [4, 2, 0, 3, 1], [2, 0]):
        step_seqs = [seqs[i] for i in batch]
        inputs = decode_inputs(runner, step_seqs)
        expected = eager_logits(runner, inputs)
        padded = static_logits(same_shapes, inputs)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = graphs.run(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(logits, padded, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        token_ids = logits.argmax(dim=-1).tolist()
        assert token_ids == expected.argmax(dim=-1).tolist()
        advance(step_seqs, token_ids)
    eager = make_runner(tiny_model_dir, "native", device="cuda", enforce_eager=True)
    assert eager.graph_runner is None


@pytest.mark.gpu
def test_cuda_runner_decodes_like_eager_runner(tiny_model_dir: Path) -> None:
    outputs = []
    for enforce_eager in (False, True):
        runner = make_runner(
            tiny_model_dir, "native", device="cuda", dtype="float32", enforce_eager=enforce_eager
        )
        assert (runner.graph_runner is None) == enforce_eager
        seqs = prefilled_seqs(runner)
        tokens = []
        for batch in ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [1, 3], [0, 1, 2]):
            step_seqs = [seqs[i] for i in batch]
            token_ids, _ = runner.execute(
                SchedulerOutput(seqs=step_seqs, num_new_tokens=[1] * len(step_seqs))
            )
            advance(step_seqs, token_ids)
            tokens.append(token_ids)
        outputs.append(tokens)
    assert outputs[0] == outputs[1]
