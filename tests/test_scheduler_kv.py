"""A model-free fuzz of the engine's step loop, async planning included: the Scheduler (with its
BlockManager, StepApplier and PrefillClaims) plans steps, the runner's host batches (built and
advanced as the ModelRunner does) say which slots each step reads and writes, and a fake paged
KV cache records in every slot the position and a digest of the whole prefix it was computed
from. So a slot counted as computed but never written, a slot read under the wrong prefix (a
bad prefix-cache hit), a position computed or sampled twice, or a token that is not the model's
choice for its prefix each fail a check. With a sliding window, each query reads its whole
window, so a block released too early (and reused) fails too."""

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

    def __init__(self, block_manager: BlockManager, digests: Digests, max_live_blocks: int) -> None:
        self.block_manager = block_manager
        self.digests = digests
        self.window = block_manager.sliding_window
        self.max_live_blocks = max_live_blocks
        self.num_dropped = 0  # seqs seen holding released blocks, summed over steps
        self.kv: list[tuple[int, int] | None] = [None] * (block_manager.num_blocks * BLOCK_SIZE)
        self.sampled: set[tuple[int, int]] = set()  # (seq_id, position) of every sample
        # NOTE: (seq_id, times preempted, position) of every write: once per admission.
        self.written: set[tuple[int, int, int]] = set()
        self.gathered = GatheredBlockTables()
        self.decode = DecodeBatch(self._advance)
        self.num_advanced = 0
        self.num_copies = 0

    @staticmethod
    def _advance(host: HostBatch, token_ids: list[int]) -> None:
        advance_host_arrays(host, BLOCK_SIZE)
        host.int64s[: host.num_tokens] = token_ids

    def launch(self, out: SchedulerOutput) -> list[int]:
        """The step's copies, writes and samples, made now (as the device runs steps in launch
        order)."""
        for source, dest, n in out.kv_copies:
            assert self.block_manager.block_hashes[source] is not None, (
                "a copy from no cached block"
            )
            assert 0 < n < BLOCK_SIZE
            start = source * BLOCK_SIZE
            self.kv[dest * BLOCK_SIZE : dest * BLOCK_SIZE + n] = self.kv[start : start + n]
            self.num_copies += 1
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
                if self.window is not None:
                    self.check_window(seq, tables[i], p)
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

    def check_window(self, seq: Sequence, table: list[int], p: int) -> None:
        """The keys a query at `p` reads, (p - window, p), hold the K/V of its own prefix."""
        assert self.window is not None
        expected = self.digests.of(seq)
        for q in range(max(0, p - self.window + 1), p):
            entry = self.kv[table[q // BLOCK_SIZE] * BLOCK_SIZE + q % BLOCK_SIZE]
            assert entry == (q, expected[q]), f"{seq} at {p} reads a stale key at {q}"

    def check_computed(self, seqs: list[Sequence]) -> None:
        """Every token a seq counts as computed has its own K/V, after its own prefix, but those
        of blocks released out of the window; those lie before every query's window."""
        for seq in seqs:
            expected = self.digests.of(seq)
            table = seq.block_table
            start = seq.num_dropped_blocks * BLOCK_SIZE
            if self.window is not None:
                assert start <= max(0, seq.num_computed_tokens - self.window)
                self.num_dropped += seq.num_dropped_blocks > 0
                num_live = len(table) - seq.num_dropped_blocks
                assert num_live <= self.max_live_blocks, seq
            else:
                assert start == 0
            for p in range(start, seq.num_computed_tokens):
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


def run_engine_loop(seed: int, is_async: bool, window: int | None = None) -> dict[str, int]:
    """One random workload through EngineCore.step()'s loop, on a model whose every layer
    attends within `window` if set; returns what it exercised."""
    rng = random.Random(seed)
    max_num_seqs = rng.randrange(2, 9)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        # NOTE: often equal to max_num_seqs: a full running set then leaves a prefill chunk of
        # one token next to the decodes.
        max_num_batched_tokens=max_num_seqs + rng.choice([0, 0, 1, 3, 12]),
        max_model_len=256,
        block_size=BLOCK_SIZE,
        # NOTE: a window frees blocks, so its pools are smaller to preempt as often.
        num_kv_blocks=rng.choice([16, 24, 64] if window is None else [10, 12, 16]),
        enable_prefix_caching=rng.random() < 0.75,
        sliding_window=window,
    )
    sched = Scheduler(config, eos_token_ids=[EOS])
    digests = Digests()
    max_live_blocks = sched.max_live_blocks if window is not None else 0
    model = FakeModel(sched.block_manager, digests, max_live_blocks)
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
        model.check_computed(sched.running)
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
        "dropped": model.num_dropped,
        "copies": model.num_copies,
    }


@pytest.mark.parametrize("window", [None, 6], ids=["global", "window6"])
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_every_computed_position_has_the_kv_of_its_own_prefix(
    is_async: bool, window: int | None
) -> None:
    totals: dict[str, int] = {}
    for seed in range(40):
        for key, value in run_engine_loop(seed, is_async, window).items():
            totals[key] = totals.get(key, 0) + value
    assert (totals["ahead"] > 1000) == is_async
    assert totals["advanced"] > 1000 and totals["preemptions"] > 300
    assert totals["prefix_hits"] > 5000 and totals["aborted"] > 20 and totals["stopped"] > 200
    assert (totals["dropped"] > 1000) == (window is not None)
    assert (totals["copies"] > 100) == (window is None), totals["copies"]
