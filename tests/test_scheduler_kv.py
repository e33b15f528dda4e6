"""A model-free fuzz of the engine's step loop, async planning included: the Scheduler (with its
BlockManager, StepApplier and PrefillClaims) plans steps, the runner's host batches (built and
advanced as the ModelRunner does) say which slots each step reads and writes, and a fake paged
KV cache records in every slot the position and a digest of the whole prefix it was computed
from. So a slot counted as computed but never written, a slot read under the wrong prefix (a
bad prefix-cache hit), a position computed or sampled twice, or a token that is not the model's
choice for its prefix each fail a check."""

from __future__ import annotations

import random

import pytest

from vbatch.engine.block_manager import BlockManager
from vbatch.engine.input_batch import (
    DecodeBatch,
    GatheredBlockTables,
    HostBatch,
    advance_host_arrays,
    build_host_batch,
)
from vbatch.engine.scheduler import Scheduler, SchedulerConfig
from vbatch.engine.sequence import Sequence
from vbatch.engine.steps import SchedulerOutput
from vbatch.protocol import FinishReason
from vbatch.sampling_params import SamplingParams

BLOCK_SIZE = 4
EOS = 2
VOCAB = 24  # small, so outputs repeat and decode-filled blocks are shared through the cache
ROOT_DIGEST = 0


def extend(token: int, previous: int) -> int:
    """The fake model's K/V at a position: its token, chained to the K/V before it."""
    return hash((previous, token))


def next_token(digest: int) -> int:
    """The fake model's greedy choice after a prefix whose last K/V is `digest`."""
    if digest % 41 == 0:
        return EOS
    return 3 + digest % (VOCAB - 3)


class Digests:
    """The K/V each seq's token prefixes must have, grown as its tokens are."""

    def __init__(self) -> None:
        self._by_seq: dict[int, list[int]] = {}

    def of(self, seq: Sequence) -> list[int]:
        digests = self._by_seq.setdefault(seq.seq_id, [])
        previous = digests[-1] if digests else ROOT_DIGEST
        for token in seq.token_ids[len(digests) :]:
            previous = extend(token, previous)
            digests.append(previous)
        return digests


class FakeModel:
    """Runs steps on a paged fake KV cache: slot -> (position, digest of the prefix through it)."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.kv: list[tuple[int, int] | None] = [None] * (block_manager.num_blocks * BLOCK_SIZE)
        self.sampled: set[tuple[int, int]] = set()  # (seq_id, position) of every sample
        # NOTE: (seq_id, times preempted, position) of every write: once per admission.
        self.written: set[tuple[int, int, int]] = set()
        self.gathered = GatheredBlockTables()
        self.decode = DecodeBatch(self._advance)
        self.num_advanced = 0

    @staticmethod
    def _advance(host: HostBatch, token_ids: list[int]) -> None:
        advance_host_arrays(host, BLOCK_SIZE)
        host.int64s[: host.num_tokens] = token_ids

    def launch(self, out: SchedulerOutput) -> list[int]:
        """The step's writes and samples, made now (as the device runs steps in launch order)."""
        kept = self.decode.host
        host = build_host_batch(out, BLOCK_SIZE, self.gathered, self.decode)
        self.num_advanced += host is kept
        input_ids = host.input_ids.tolist()
        positions = host.positions.tolist()
        slots = host.slot_mapping.tolist()
        starts = host.query_start_loc.tolist()
        seq_lens = host.seq_lens.tolist()
        tables = host.block_tables.tolist()
        block_hashes = self.block_manager.block_hashes
        row_digests = []
        for i, seq in enumerate(out.seqs):
            assert positions[starts[i + 1] - 1] == seq_lens[i] - 1
            for row in range(starts[i], starts[i + 1]):
                p = positions[row]
                write = (seq.seq_id, seq.num_preemptions, p)
                assert write not in self.written, f"position {p} of {seq} computed twice"
                self.written.add(write)
                slot = slots[row]
                assert slot == tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                assert block_hashes[slot // BLOCK_SIZE] is None, "a cached block is written"
                if p == 0:
                    previous = ROOT_DIGEST
                else:
                    q = p - 1
                    entry = self.kv[tables[i][q // BLOCK_SIZE] * BLOCK_SIZE + q % BLOCK_SIZE]
                    assert entry is not None and entry[0] == q, "a read of a slot never written"
                    previous = entry[1]
                digest = extend(input_ids[row], previous)
                self.kv[slot] = (p, digest)
                row_digests.append(digest)
        tokens = []
        for i in host.sample_rows:
            row = starts[i + 1] - 1
            key = (out.seqs[i].seq_id, positions[row])
            assert key not in self.sampled, f"position {key[1]} of seq {key[0]} sampled twice"
            self.sampled.add(key)
            tokens.append(next_token(row_digests[row]))
        self.decode.record(out.step_id, tokens)
        return tokens

    def check_computed(self, seqs: list[Sequence], digests: Digests) -> None:
        """Every token a seq counts as computed has its own K/V, after its own prefix."""
        for seq in seqs:
            expected = digests.of(seq)
            table = seq.block_table
            for p in range(seq.num_computed_tokens):
                slot = table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                assert self.kv[slot] == (p, expected[p]), (seq, p)


def random_request(rng: random.Random, shared: list[int], num_kv_blocks: int) -> tuple:
    prefix = shared[: rng.choice([0, 0, 5, 8, 13])]
    prompt = prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 14))]
    max_len = num_kv_blocks * BLOCK_SIZE - len(prompt)
    max_tokens = min(rng.randrange(1, 48), max_len)
    params = SamplingParams(
        n=rng.choice([1, 1, 1, 2, 3]),
        max_tokens=max_tokens,
        ignore_eos=rng.random() < 0.3,
        stop_token_ids=[rng.randrange(3, VOCAB)] if rng.random() < 0.2 else [],
        min_tokens=min(rng.choice([0] * 9 + [2]), max_tokens),
    )
    return prompt, params


def run_engine_loop(seed: int, is_async: bool) -> dict[str, int]:
    """One random workload through EngineCore.step()'s loop; returns what it exercised."""
    rng = random.Random(seed)
    max_num_seqs = rng.randrange(2, 9)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        # NOTE: often equal to max_num_seqs: a full running set then leaves a prefill chunk of
        # one token next to the decodes.
        max_num_batched_tokens=max_num_seqs + rng.choice([0, 0, 1, 3, 12]),
        max_model_len=256,
        block_size=BLOCK_SIZE,
        num_kv_blocks=rng.choice([16, 24, 64]),
        enable_prefix_caching=rng.random() < 0.75,
    )
    sched = Scheduler(config, eos_token_ids=[EOS])
    model = FakeModel(sched.block_manager)
    digests = Digests()
    shared = [rng.randrange(3, VOCAB) for _ in range(13)]
    seqs: list[Sequence] = []
    requests: dict[str, list[Sequence]] = {}

    def add_request() -> None:
        prompt, params = random_request(rng, shared, config.num_kv_blocks)
        request_id = str(len(requests))
        request = [Sequence(request_id, prompt, params, i) for i in range(params.n)]
        requests[request_id] = request
        for seq in request:
            sched.add(seq)
            seqs.append(seq)

    for _ in range(rng.randrange(3, 12)):
        add_request()
    ahead: tuple[SchedulerOutput, list[int]] | None = None
    num_ahead = 0
    for num_steps in range(5000):
        if not (sched.has_unfinished() or ahead):
            break
        if num_steps % 7 == 3 and len(requests) < 30:
            add_request()
        if ahead is not None:
            out, tokens = ahead
            ahead = None
        else:
            out = sched.schedule()
            if out.is_empty:
                continue
            tokens = model.launch(out)
        if is_async:
            planned = sched.schedule_ahead(out)
            if planned is not None:
                num_ahead += 1
                ahead = (planned, model.launch(planned))
        if rng.random() < 0.01:
            # NOTE: a client's abort, landing while the step runs.
            victim = rng.choice(list(requests.values()))
            sched.abort([seq for seq in victim if not seq.is_finished])
        for seq, num_new, is_sampling in zip(
            out.seqs, out.num_new_tokens, out.sampling_mask, strict=True
        ):
            # NOTE: a step planned ahead finds its seqs moved on by the step before it.
            if seq.finish_reason is None:
                end = seq.num_computed_tokens + num_new
                assert end == seq.num_tokens if is_sampling else end < seq.num_tokens
        update = sched.update(out, tokens)
        assert len(update.token_ids) == len(update.seqs)
        model.check_computed(sched.running, digests)
    else:
        raise AssertionError("the workload did not finish")
    assert sched.block_manager.usage == 0.0
    for seq in seqs:
        assert seq.is_finished
        if seq.finish_reason == FinishReason.ABORT:
            continue
        expected = digests.of(seq)
        for p in range(seq.num_prompt_tokens, seq.num_tokens):
            assert seq.token_ids[p] == next_token(expected[p - 1]), (seq, p)
    return {
        "ahead": num_ahead,
        "advanced": model.num_advanced,
        "preemptions": sched.num_preemptions,
        "prefix_hits": sched.block_manager.num_prefix_hits,
        "aborted": sum(seq.finish_reason == FinishReason.ABORT for seq in seqs),
        "stopped": sum(seq.finish_reason == FinishReason.STOP for seq in seqs),
    }


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_every_computed_position_has_the_kv_of_its_own_prefix(is_async: bool) -> None:
    totals: dict[str, int] = {}
    for seed in range(40):
        for key, value in run_engine_loop(seed, is_async).items():
            totals[key] = totals.get(key, 0) + value
    assert (totals["ahead"] > 1000) == is_async
    assert totals["advanced"] > 1000 and totals["preemptions"] > 300
    assert totals["prefix_hits"] > 5000 and totals["aborted"] > 20 and totals["stopped"] > 200
