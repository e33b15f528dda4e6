"""BlockManager: the pool of paged-KV blocks, their ref counts and the prefix cache (torch-free)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceOf

import numpy as np

from vbatch.engine.sequence import Sequence

HashFn = Callable[[int, tuple[int, ...]], int]
ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: its tokens and, through the parent, all tokens before."""
    # NOTE: the builtin tuple hash is ~6x faster than blake2b here and is stable for ints across
    # processes; collisions are caught by comparing the stored key on every hit.
    return hash((parent_hash, token_ids))


class BlockManager:
    """Hands out KV blocks to sequences and shares full blocks between equal prefixes.

    Invariants: every block is in exactly one of {in use (ref > 0), cached-free (ref == 0, hashed,
    in the LRU), free (ref == 0, unhashed, in the free list)}; a hashed block holds the K/V of
    exactly the tokens of its key, after exactly the prefix its parent hash names, and is never
    written again while hashed. Prefix counters count tokens. A seq holding blocks owns row
    `seq.block_row` of `tables`, which holds its block table and then zeros; free rows are zero;
    `tables_version` changes whenever `tables` does.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = hash_block,
    ) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.ref_counts = [0] * num_blocks
        # NOTE: popped from the end, so block 0 goes out first and freed blocks are reused soonest.
        self.free_block_ids = list(range(num_blocks - 1, -1, -1))
        self.cached_free_block_ids: OrderedDict[int, None] = OrderedDict()  # least recent first
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.block_keys: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.seq_block_hashes: dict[int, list[int]] = {}  # seq_id -> hashes of its leading blocks
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        # NOTE: the runner gathers a step's block tables from these rows with one numpy call
        # instead of converting every seq's list each step; both grow by doubling.
        self.tables = np.zeros((64, 16), dtype=np.int32)
        self.tables_version = 0  # bumped by every write to `tables`
        self._free_rows = list(range(63, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: truly free plus cached-free (evictable)."""
        return len(self.free_block_ids) + len(self.cached_free_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by sequences, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding `seq`'s leading full blocks; never all of its tokens."""
        if not self.enable_prefix_caching:
            return []
        block_ids: list[int] = []
        # NOTE: the last token is never a hit, so the step that computes it can sample.
        num_blocks = (len(seq.token_ids) - 1) // self.block_size
        for key, block_hash in self._block_keys(seq.token_ids, ROOT_HASH, 0, num_blocks):
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None or self.block_keys[block_id] != key:
                break
            block_ids.append(block_id)
        return block_ids

    def uncached_prompt_hashes(
        self, seq: Sequence, cached_blocks: SequenceOf[int], limit: int | None = None
    ) -> list[int]:
        """The chained hashes of the full blocks match_prefix could return for `seq` after its
        `cached_blocks` (at most `limit` of them): the keys those blocks will be cached under."""
        parent = self.block_hashes[cached_blocks[-1]] if cached_blocks else ROOT_HASH
        start = len(cached_blocks)
        stop = (len(seq.token_ids) - 1) // self.block_size
        if limit is not None:
            stop = min(stop, start + limit)
        return [h for _, h in self._block_keys(seq.token_ids, parent, start, stop)]

    def can_allocate(self, num_new_tokens: int, cached_blocks: SequenceOf[int] = ()) -> bool:
        """Whether a new seq reusing `cached_blocks` can get blocks for `num_new_tokens` more."""
        num_needed = -(-num_new_tokens // self.block_size)
        num_revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        return num_needed + num_revived <= self.num_free_blocks

    def allocate(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: SequenceOf[int] = ()
    ) -> None:
        """Admit `seq`: share `cached_blocks` (from match_prefix), then add blocks for the rest."""
        assert not seq.block_table and seq.num_computed_tokens == 0 and seq.block_row < 0
        if not self._free_rows:
            num_rows = len(self.tables)
            self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
            self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        seq.block_row = self._free_rows.pop()
        ref_counts = self.ref_counts
        for block_id in cached_blocks:
            if ref_counts[block_id] == 0:
                del self.cached_free_block_ids[block_id]
            ref_counts[block_id] += 1
        seq.block_table.extend(cached_blocks)
        self._mirror(seq, 0)
        num_cached_tokens = len(cached_blocks) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens = num_cached_tokens
        if self.enable_prefix_caching:
            self.seq_block_hashes[seq.seq_id] = [self.block_hashes[b] for b in cached_blocks]
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += num_cached_tokens
        is_allocated = self.append_slots(seq, num_new_tokens)
        assert is_allocated, "allocate() without a successful can_allocate()"

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block table to hold num_computed_tokens + num_new_tokens; False if no room."""
        num_needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(
            seq.block_table
        )
        if num_needed <= 0:
            return True
        if num_needed > len(self.free_block_ids) + len(self.cached_free_block_ids):
            return False
        block_table = seq.block_table
        start = len(block_table)
        for _ in range(num_needed):
            block_table.append(self._take_free_block())
        self._mirror(seq, start)
        return True

    def append_blocks(self, seqs: list[Sequence], lookahead: int = 0) -> bool:
        """Room for one more token in each of `seqs` (beyond `lookahead` tokens each has yet to
        take), with one write to `tables` for all of them; False, changing nothing, if the pool
        has too few blocks for the seqs that need one."""
        # NOTE: decode steps reach block boundaries together (all seqs at once when prompts are
        # equally long); one numpy write instead of one per seq.
        block_size = self.block_size
        needy = [
            seq
            for seq in seqs
            if len(seq.token_ids) - seq.num_uncomputed_tokens + lookahead
            >= len(seq.block_table) * block_size
        ]
        if len(needy) > self.num_free_blocks:
            return False
        if not needy:
            return True
        self._ensure_width(max(len(seq.block_table) for seq in needy) + 1)
        rows, columns, block_ids = [], [], []
        for seq in needy:
            block_id = self._take_free_block()
            rows.append(seq.block_row)
            columns.append(len(seq.block_table))
            block_ids.append(block_id)
            seq.block_table.append(block_id)
        self.tables[rows, columns] = block_ids
        self.tables_version += 1
        return True

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; hashed ones stay cached until evicted."""
        ref_counts = self.ref_counts
        # NOTE: tail blocks first, so the LRU evicts a prompt's shareable head last.
        for block_id in reversed(seq.block_table):
            ref_counts[block_id] -= 1
            assert ref_counts[block_id] >= 0
            if ref_counts[block_id] == 0:
                if self.block_hashes[block_id] is None:
                    self.free_block_ids.append(block_id)
                else:
                    self.cached_free_block_ids[block_id] = None
        if seq.block_row >= 0:
            # NOTE: zeroed so that a gathered row is 0-padded past its seq's last block.
            self.tables[seq.block_row, : len(seq.block_table)] = 0
            self.tables_version += 1
            self._free_rows.append(seq.block_row)
            seq.block_row = -1
        seq.block_table.clear()
        self.seq_block_hashes.pop(seq.seq_id, None)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of `seq`'s blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        hashes = self.seq_block_hashes.setdefault(seq.seq_id, [])
        start = len(hashes)
        parent = hashes[-1] if hashes else ROOT_HASH
        stop = seq.num_computed_tokens // self.block_size
        block_keys = self._block_keys(seq.token_ids, parent, start, stop)
        for i, (key, block_hash) in enumerate(block_keys, start):
            cached_block_id = self.hash_to_block.get(block_hash)
            if cached_block_id is None:
                block_id = seq.block_table[i]
                self.block_hashes[block_id] = block_hash
                self.block_keys[block_id] = key
                self.hash_to_block[block_hash] = block_id
            elif self.block_keys[cached_block_id] != key:
                # NOTE: a hash collision: this block and the ones after it stay private to seq.
                return
            # NOTE: an equal block cached by another seq leaves ours unhashed; the chain goes on.
            hashes.append(block_hash)

    def _block_keys(
        self, token_ids: list[int], parent: int, start: int, stop: int
    ) -> Iterator[tuple[tuple[int, tuple[int, ...]], int]]:
        """(key, chained hash) of blocks start..stop-1 of `token_ids`; `parent` is the hash of
        block start - 1 (ROOT_HASH for the first block)."""
        bs = self.block_size
        for i in range(start, stop):
            key = (parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            parent = self.hash_fn(*key)
            yield key, parent

    def _mirror(self, seq: Sequence, start: int) -> None:
        """Copy seq.block_table[start:] into its row of `tables`."""
        block_table = seq.block_table
        self._ensure_width(len(block_table))
        if start < len(block_table):
            self.tables[seq.block_row, start : len(block_table)] = block_table[start:]
            self.tables_version += 1

    def _ensure_width(self, num_blocks: int) -> None:
        """Widen `tables` (by doubling) to hold block tables of num_blocks blocks."""
        if num_blocks > self.tables.shape[1]:
            width = self.tables.shape[1]
            while width < num_blocks:
                width *= 2
            grown = np.zeros((len(self.tables), width), dtype=np.int32)
            grown[:, : self.tables.shape[1]] = self.tables
            self.tables = grown

    def _take_free_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.pop()
        else:
            block_id, _ = self.cached_free_block_ids.popitem(last=False)
            del self.hash_to_block[self.block_hashes[block_id]]
            self.block_hashes[block_id] = None
            self.block_keys[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id
