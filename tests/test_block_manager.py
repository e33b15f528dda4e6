"""Tests for the BlockManager: pool accounting, ref counts, prefix caching and LRU eviction."""

import sys

import pytest

from vbatch.engine.block_manager import NULL_BLOCK, ROOT_HASH, BlockManager, hash_block
from vbatch.engine.sequence import Sequence
from vbatch.sampling_params import SamplingParams


def make_seq(token_ids: list[int]) -> Sequence:
    return Sequence("r", token_ids, SamplingParams())


def check_invariants(bm: BlockManager, live_seqs: list[Sequence]) -> None:
    """Each block is in exactly one state, and ref counts equal block-table occurrences."""
    free = set(bm.free_block_ids)
    cached_free = set(bm.cached_free_block_ids)
    assert len(free) == len(bm.free_block_ids)
    assert not free & cached_free
    occurrences = [0] * bm.num_blocks
    for block_id in bm.pinned:
        occurrences[block_id] += 1
    for seq in live_seqs:
        assert seq.block_table[: seq.num_dropped_blocks] == [NULL_BLOCK] * seq.num_dropped_blocks
        for block_id in seq.block_table[seq.num_dropped_blocks :]:
            occurrences[block_id] += 1
    assert occurrences == bm.ref_counts
    for block_id in range(bm.num_blocks):
        ref_count = bm.ref_counts[block_id]
        is_hashed = bm.block_hashes[block_id] is not None
        assert ref_count >= 0
        assert (ref_count > 0) + (block_id in free) + (block_id in cached_free) == 1
        assert (block_id in cached_free) <= is_hashed
        assert (block_id in free) <= (not is_hashed)
        if is_hashed:
            assert bm.hash_to_block[bm.block_hashes[block_id]] == block_id
    assert len(bm.hash_to_block) == sum(h is not None for h in bm.block_hashes)
    rows = [seq.block_row for seq in live_seqs if seq.block_table]
    assert len(set(rows)) == len(rows) and not set(rows) & set(bm.free_rows)
    for seq in live_seqs:
        if seq.block_table:
            row = bm.tables[seq.block_row].tolist()
            assert row == seq.block_table + [0] * (len(row) - len(seq.block_table))
    assert not bm.tables[bm.free_rows].any()


def admit(bm: BlockManager, seq: Sequence) -> None:
    """Allocate `seq` with its prefix hits, as if its whole remaining prompt were computed."""
    cached_blocks = bm.match_prefix(seq)
    num_new = seq.num_tokens - len(cached_blocks) * bm.block_size
    assert bm.can_allocate(num_new, cached_blocks)
    bm.allocate(seq, num_new, cached_blocks)


def admit_sharing(bm: BlockManager, seq: Sequence) -> tuple[int, int]:
    """admit() with the head of a cached block after the whole ones; returns the partial hit."""
    cached_blocks = bm.match_prefix(seq)
    partial = bm.match_partial(seq, cached_blocks)
    num_new = seq.num_tokens - len(cached_blocks) * bm.block_size - partial[1]
    assert bm.can_allocate(num_new, cached_blocks, partial)
    bm.allocate(seq, num_new, cached_blocks, partial)
    return partial


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_append_blocks_grows_only_full_tables_in_one_write() -> None:
    """Decode seqs each about to take one token: those whose blocks are full get one more."""
    bm = BlockManager(num_blocks=7, block_size=4)
    seqs = [make_seq(list(range(n))) for n in (4, 5, 8)]
    for seq in seqs:
        bm.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        seq.append_token(99)
    assert [len(seq.block_table) for seq in seqs] == [1, 2, 2]
    version = bm.tables_version
    assert bm.append_blocks(seqs)
    assert [len(seq.block_table) for seq in seqs] == [2, 2, 3]
    assert bm.tables_version == version + 1 and bm.num_free_blocks == 0
    check_invariants(bm, seqs)
    # NOTE: the first seq's two blocks are full once it has computed 8 tokens; none is left.
    first = seqs[0]
    while first.num_tokens < 9:
        first.append_token(7)
    first.num_computed_tokens = 8
    tables = [list(seq.block_table) for seq in seqs]
    assert not bm.append_blocks(seqs)
    assert [seq.block_table for seq in seqs] == tables and bm.tables_version == version + 1
    check_invariants(bm, seqs)


def test_allocate_append_free_and_usage() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    assert bm.can_allocate(10)
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert seq.num_computed_tokens == seq.num_cached_tokens == 0
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    check_invariants(bm, [seq])

    seq.num_computed_tokens = 10
    assert bm.append_slots(seq, 2)
    assert len(seq.block_table) == 3
    assert bm.append_slots(seq, 3)
    assert len(seq.block_table) == 4
    assert not bm.append_slots(seq, 23)
    assert len(seq.block_table) == 4, "a failed append_slots allocates nothing"
    check_invariants(bm, [seq])

    bm.free(seq)
    assert seq.block_table == []
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    check_invariants(bm, [])


def test_can_allocate_counts_the_whole_pool() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.can_allocate(16)
    assert not bm.can_allocate(17)


def test_prefix_hits_share_blocks_across_sequences() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 110))
    a = make_seq(prompt)
    admit(bm, a)
    compute_all(bm, a)
    assert bm.num_cached_blocks == 2
    assert a.num_cached_tokens == 0

    b = make_seq([*prompt[:8], 7, 7, 7])
    admit(bm, b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (10 + 11, 8)
    check_invariants(bm, [a, b])

    c = make_seq([*prompt[:4], 9, 9, 9, 9, 9])
    assert bm.match_prefix(c) == a.block_table[:1]

    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16
    check_invariants(bm, [])


def test_cache_never_covers_the_last_token() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(8)))
    admit(bm, a)
    compute_all(bm, a)
    assert bm.num_cached_blocks == 2
    b = make_seq(list(range(8)))
    admit(bm, b)
    assert b.num_cached_tokens == 4
    assert len(b.block_table) == 2 and b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]


def test_cached_free_blocks_are_reused_after_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(9)))
    admit(bm, a)
    compute_all(bm, a)
    full_blocks = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    assert set(bm.cached_free_block_ids) == set(full_blocks)
    check_invariants(bm, [])

    b = make_seq(list(range(9)))
    admit(bm, b)
    assert b.block_table[:2] == full_blocks
    assert b.num_cached_tokens == 8
    assert not bm.cached_free_block_ids
    check_invariants(bm, [b])


# NOTE: two 16-token blocks with equal CPython tuple hashes (found with Brent's cycle search on
# the tuple hash, about 10^10 evaluations): under the old keys, (parent_hash, tokens) hashed with
# hash(), each had the other's children.
COLLIDING_X = [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 1367, 582, 986, 4576, 41]
COLLIDING_Y = [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 7347, 2234, 1720, 4447, 3525]


def test_a_block_re_registered_by_a_colliding_one_keeps_its_children_apart() -> None:
    if sys.implementation.name == "cpython":
        assert hash(tuple(COLLIDING_X)) == hash(tuple(COLLIDING_Y))
    bm = BlockManager(num_blocks=8, block_size=16)
    after = list(range(300, 316))  # a block cached after X
    a = make_seq([*COLLIDING_X, 7])
    admit(bm, a)
    compute_all(bm, a)
    # NOTE: b computed its own copy of X (as two samples decoding the same tokens do), so its
    # next block is cached under X's chain while the cached X is a's block.
    b = make_seq([*COLLIDING_X, *after, 7])
    bm.allocate(b, b.num_tokens)
    compute_all(bm, b)
    assert bm.block_hashes[b.block_table[0]] is None
    assert bm.block_hashes[b.block_table[1]] is not None
    bm.free(a)
    filler = make_seq(list(range(1000, 1080)))
    admit(bm, filler)  # evicts a's X from the cache
    bm.free(filler)
    assert bm.match_prefix(make_seq([*COLLIDING_X, 7])) == []
    c = make_seq([*COLLIDING_Y, 7])
    admit(bm, c)
    compute_all(bm, c)
    bm.free(b)
    check_invariants(bm, [c])
    # NOTE: the block after X must not match after Y, whatever their hashes.
    d = make_seq([*COLLIDING_Y, *after, 7])
    assert bm.match_prefix(d) == [c.block_table[0]]
    assert bm.match_prefix(make_seq([*COLLIDING_X, *after, 7])) == []


def test_equal_blocks_computed_twice_keep_the_chain_going() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq([1, 2, 3, 4, 5])
    b = make_seq([1, 2, 3, 4, 6, 6, 6, 6, 0])
    admit(bm, a)
    admit(bm, b)
    compute_all(bm, a)
    compute_all(bm, b)
    assert bm.block_hashes[b.block_table[0]] is None
    assert bm.block_hashes[b.block_table[1]] is not None
    c = make_seq([1, 2, 3, 4, 6, 6, 6, 6, 1])
    admit(bm, c)
    assert c.block_table[:2] == [a.block_table[0], b.block_table[1]]
    assert c.num_cached_tokens == 8
    check_invariants(bm, [a, b, c])


def test_lru_eviction_of_cached_free_blocks() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    prompts = {"a": [10, 11, 0], "b": [20, 21, 0], "c": [30, 31, 0]}
    seqs = {name: make_seq(prompt) for name, prompt in prompts.items()}
    for seq in seqs.values():
        admit(bm, seq)
        compute_all(bm, seq)
    head = {name: seq.block_table[0] for name, seq in seqs.items()}
    for seq in seqs.values():
        bm.free(seq)
    assert list(bm.cached_free_block_ids) == [head["a"], head["b"], head["c"]]

    b_again = make_seq(prompts["b"])
    admit(bm, b_again)
    assert b_again.block_table[0] == head["b"]
    bm.free(b_again)
    assert list(bm.cached_free_block_ids) == [head["a"], head["c"], head["b"]]
    check_invariants(bm, [])

    d = make_seq(list(range(100, 108)))
    admit(bm, d)
    assert head["a"] in d.block_table, "truly free blocks go first, then the least recent"
    assert bm.match_prefix(make_seq(prompts["a"])) == []
    e = make_seq([200, 201])
    admit(bm, e)
    assert e.block_table == [head["c"]]
    assert bm.match_prefix(make_seq(prompts["c"])) == []
    assert bm.match_prefix(make_seq(prompts["b"])) == [head["b"]]
    check_invariants(bm, [d, e])


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq(list(range(9)))
    admit(bm, a)
    compute_all(bm, a)
    assert bm.num_cached_blocks == 0
    b = make_seq(list(range(9)))
    assert bm.match_prefix(b) == []
    bm.free(a)
    assert not bm.cached_free_block_ids and bm.num_free_blocks == 8
    assert bm.num_prefix_queries == bm.num_prefix_hits == 0


def test_hash_block_digests_the_parent_and_every_token() -> None:
    digest = hash_block(ROOT_HASH, (1, 2))
    assert digest == hash_block(ROOT_HASH, [1, 2]) and len(digest) == 32
    assert digest != hash_block(digest, (1, 2))
    variants = [(1, 2), (2, 1), (1, 2, 0), (1,), (1, 2**40), (1, -2), (1, -1)]
    assert len({hash_block(ROOT_HASH, t) for t in variants}) == len(variants)


def test_each_block_of_a_seq_is_hashed_once_and_chained_by_hash_block() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(3, 16)))
    assert bm.match_prefix(a) == [] and len(a.full_block_hashes) == 3
    expected = []
    parent = ROOT_HASH
    for i in range(3):
        parent = hash_block(parent, a.token_ids[4 * i : 4 * i + 4])
        expected.append(parent)
    assert a.full_block_hashes == expected
    memo = a.full_block_hashes[0]
    admit(bm, a)
    compute_all(bm, a)
    assert [bm.block_hashes[b] for b in a.block_table[:3]] == expected
    assert a.full_block_hashes[0] is memo, "not hashed again"
    for token_id in (16, 17, 18):  # its fourth block fills up
        a.append_token(token_id)
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)
    assert a.full_block_hashes[:3] == expected and len(a.full_block_hashes) == 4
    assert bm.block_hashes[a.block_table[3]] == hash_block(expected[-1], [15, 16, 17, 18])
    b = make_seq(list(range(3, 16)))
    assert bm.uncached_prompt_hashes(b, []) == expected


def test_blocks_behind_the_window_are_released_and_stay_cached() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, sliding_window=6)
    tokens = list(range(100, 130))
    seq = make_seq(tokens)
    admit(bm, seq)
    blocks = list(seq.block_table)
    assert len(blocks) == 8 and bm.num_free_blocks == 8
    seq.num_computed_tokens = 20
    bm.release_out_of_window([seq])
    assert seq.num_dropped_blocks == 0, "not registered yet: nothing is released"
    bm.cache_full_blocks(seq)
    bm.release_out_of_window([seq])
    # NOTE: the next query (position 20) reads positions 15-20: blocks 0-2 end before them.
    assert seq.num_dropped_blocks == 3 and bm.num_free_blocks == 11
    assert seq.block_table == [NULL_BLOCK] * 3 + blocks[3:]
    check_invariants(bm, [seq])
    compute_all(bm, seq)
    bm.release_out_of_window([seq])
    assert seq.num_dropped_blocks == 6 and bm.num_free_blocks == 14
    check_invariants(bm, [seq])
    # NOTE: a second seq with the same prompt matches 7 cached blocks and, 28 tokens in, takes
    # only those its window still reads.
    twin = make_seq(tokens)
    cached = bm.match_prefix(twin)
    assert cached == blocks[:7]
    admit(bm, twin)
    assert twin.num_dropped_blocks == 5 and twin.block_table[5:7] == blocks[5:7]
    assert twin.num_computed_tokens == 28
    check_invariants(bm, [seq, twin])
    bm.free(seq)
    bm.free(twin)
    check_invariants(bm, [])
    assert bm.usage == 0.0 and seq.num_dropped_blocks == twin.num_dropped_blocks == 0


def test_table_rows_grow_and_are_reused_zeroed() -> None:
    bm = BlockManager(num_blocks=4000, block_size=2, enable_prefix_caching=False)
    seqs = [make_seq(list(range(3, 40 + i))) for i in range(70)]
    for seq in seqs:
        admit(bm, seq)
    assert bm.tables.shape[0] >= 70 and bm.tables.shape[1] >= len(seqs[-1].block_table) > 16
    check_invariants(bm, seqs)
    version = bm.tables_version
    for seq in seqs[::2]:
        bm.free(seq)
    assert bm.tables_version > version
    check_invariants(bm, seqs[1::2])
    version = bm.tables_version
    assert bm.append_slots(seqs[1], 0) and bm.tables_version == version
    short = make_seq([5, 6, 7])
    admit(bm, short)
    assert bm.tables_version > version
    check_invariants(bm, [*seqs[1::2], short])


def test_a_prefix_ending_inside_a_block_copies_the_head_of_a_cached_block() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    compute_all(bm, a)
    source = a.block_table[1]
    b = make_seq([1, 2, 3, 4, 5, 6, 0, 0, 0, 0])
    assert admit_sharing(bm, b) == (source, 2)
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert b.num_computed_tokens == b.num_cached_tokens == 6
    assert bm.num_prefix_hits == 6
    assert bm.take_copies() == [(source, b.block_table[1], 2)]
    assert bm.take_copies() == []
    check_invariants(bm, [a, b])
    # NOTE: the pin holds the source when its seq is gone, until the step has copied it.
    bm.free(a)
    assert bm.ref_counts[source] == 1 and source not in bm.cached_free_block_ids
    bm.unpin()
    assert source in bm.cached_free_block_ids and not bm.pinned
    check_invariants(bm, [b])


def test_a_partial_hit_takes_the_longest_head_and_never_the_last_token() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    for prompt in ([1, 2, 3, 4, 5, 9, 9, 9, 0], [1, 2, 3, 4, 5, 6, 7, 8, 0]):
        seq = make_seq(prompt)
        admit(bm, seq)
        compute_all(bm, seq)
    longest = bm.hash_to_block[hash_block(hash_block(ROOT_HASH, [1, 2, 3, 4]), [5, 6, 7, 8])]
    assert bm.match_partial(make_seq([1, 2, 3, 4, 5, 6, 7, 0, 0]), [bm.tables[1, 0]]) == (
        longest,
        3,
    )
    last_is_the_next = make_seq([1, 2, 3, 4, 5, 6, 7, 8])
    assert admit_sharing(bm, last_is_the_next) == (longest, 3)
    assert last_is_the_next.num_computed_tokens == 7
    assert bm.match_partial(
        make_seq([1, 2, 3, 4, 6]), bm.match_prefix(make_seq([1, 2, 3, 4, 6]))
    ) == (
        -1,
        0,
    )


def test_a_partial_hit_needs_the_same_prefix_and_the_same_adapter() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    admit(bm, a)
    compute_all(bm, a)
    other_head = make_seq([9, 2, 3, 4, 5, 6, 0])
    assert admit_sharing(bm, other_head) == (-1, 0) and other_head.num_computed_tokens == 0
    assert admit_sharing(bm, make_seq([1, 2, 3, 0])) == (a.block_table[0], 3)
    adapted = Sequence("r", [1, 2, 3, 0], SamplingParams(), lora_id=1)
    assert admit_sharing(bm, adapted) == (-1, 0)


def cached_and_freed(bm: BlockManager, prompt: list[int]) -> int:
    """Run `prompt` through `bm` and free it; returns its first block, now cached-free."""
    seq = make_seq(prompt)
    admit(bm, seq)
    compute_all(bm, seq)
    first = seq.block_table[0]
    bm.free(seq)
    return first


def test_an_evicted_block_is_no_partial_hit() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    cached = cached_and_freed(bm, [1, 2, 3, 4, 5])
    filler = make_seq(list(range(100, 116)))
    admit(bm, filler)
    bm.free(filler)
    assert bm.block_hashes[cached] is None
    assert admit_sharing(bm, make_seq([1, 2, 3, 9])) == (-1, 0)
    assert not bm._partial and not bm._partial_keys


def test_a_pinned_source_counts_against_the_pool_and_is_not_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    source = cached_and_freed(bm, [1, 2, 3, 4, 5])
    b = make_seq([1, 2, 3, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8])
    partial = bm.match_partial(b, [])
    assert partial == (source, 3)
    assert not bm.can_allocate(b.num_tokens - 3, [], partial), "3 blocks and the source: 4 + 1"
    b = make_seq([1, 2, 3, 8, 8, 8, 8, 8, 8, 8, 8, 8])
    assert admit_sharing(bm, b) == (source, 3)
    assert source not in b.block_table and bm.num_free_blocks == 0
    check_invariants(bm, [b])


def test_a_sliding_window_shares_whole_blocks_only() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, sliding_window=8)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    admit(bm, a)
    compute_all(bm, a)
    assert admit_sharing(bm, make_seq([1, 2, 3, 4, 5, 6, 0])) == (-1, 0)
