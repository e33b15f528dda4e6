"""BlockManager: the pool of paged-KV blocks, their ref counts and the prefix cache (torch-free)."""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf

import numpy as np

from vbatch.engine.sequence import Sequence

BlockHash = bytes
_sha256 = hashlib.sha256
# NOTE: the parent of a first block: secret and random per process, so no one can search for
# colliding prompts offline (CPython's tuple hash, the key before issue 12, has collisions found
# in minutes).
ROOT_HASH: BlockHash = os.urandom(32)
# NOTE: the parent of a first block whose K/V were made with longrope's long factors, which
# differ from the short factors' K/V of the same tokens.
LONG_ROPE_ROOT_HASH: BlockHash = _sha256(ROOT_HASH + b"longrope:long").digest()
# NOTE: what a block-table entry released out of the sliding window holds. Attention never
# reads it: the kernels start at the window, and the torch decode path masks what it gathers.
NULL_BLOCK = 0


def hash_block(parent_hash: BlockHash, token_ids: SequenceOf[int]) -> BlockHash:
    """Chained digest of one full block: its tokens and, through the parent, all tokens before.

    SHA-256 of the parent's digest and the token ids as int64s. Blocks with equal digests hold
    the same tokens after the same prefix, so a hit needs no further check.
    """
    return _sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def root_hash(seq: Sequence) -> BlockHash:
    """The parent of `seq`'s first block: it keys what, besides the tokens, its K/V depend on
    (longrope's long factors; its LoRA adapter, whose K/V of the same tokens differ), and its
    cache salt, which only requests with the same salt share."""
    root = LONG_ROPE_ROOT_HASH if seq.long_rope else ROOT_HASH
    if seq.lora_id:
        root = _sha256(root + b"lora:" + seq.lora_id.to_bytes(8, "little")).digest()
    if seq.cache_salt is not None:
        root = _sha256(root + b"salt:" + seq.cache_salt.encode("utf-8", "surrogatepass")).digest()
    return root


class BlockManager:
    """Hands out KV blocks to sequences and shares full blocks between equal prefixes, and the
    leading tokens of a cached block with a prefix that ends inside a block (match_partial).

    Invariants: every block is in exactly one of {in use (ref > 0), cached-free (ref == 0, hashed,
    in the LRU), free (ref == 0, unhashed, in the free list)}; a hashed block holds the K/V of
    exactly the tokens its chained hash digests, after exactly the prefix its parent hash
    digests, made as its chain's root says (root_hash), and is never written again while
    hashed. The first `_num_registered[seq_id]` blocks of a seq holding blocks are hashed, or
    equal to hashed ones. Prefix counters count tokens. A seq holding blocks owns row
    `seq.block_row` of `tables`, which holds its block table and then zeros; free rows are zero;
    `tables_version` changes whenever `tables` does. `_partial` maps the parent hash and leading
    tokens (1 to block_size - 1 of them) of hashed blocks to one such block, each key listed in
    `_partial_keys` of the block it maps to. A block in `pinned` holds one reference more than
    block tables do, for a copy in `pending_copies` (source, destination, tokens) that the next
    step runs before its forward pass.

    With `sliding_window` W (set only when every layer of the model has a window of at most
    W), a seq's leading blocks that end before position `num_computed_tokens - W` are needed by
    no query to come: `release_out_of_window` gives them back (hashed ones stay cached) and
    leaves NULL_BLOCK in their entries, which keep their positions.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        prompt_blocks_only: bool = False,
    ) -> None:
        assert num_blocks > 0 and block_size > 0
        assert sliding_window is None or sliding_window > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        # NOTE: batch-invariant mode: a prompt's K/V come from prefill chunks and an output's
        # from decode rows, which round differently, so only prompt positions are shared, with
        # prompt positions.
        self.prompt_blocks_only = prompt_blocks_only
        self.ref_counts = [0] * num_blocks
        # NOTE: popped from the end, so block 0 goes out first and freed blocks are reused soonest.
        self.free_block_ids = list(range(num_blocks - 1, -1, -1))
        self.cached_free_block_ids: OrderedDict[int, None] = OrderedDict()  # least recent first
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.hash_to_block: dict[BlockHash, int] = {}
        self._num_registered: dict[int, int] = {}  # seq_id -> leading blocks cache_full_blocks saw
        # NOTE: a sliding window drops leading blocks by count, which assumes whole-block hits.
        self.shares_partial_blocks = enable_prefix_caching and sliding_window is None
        self._partial: dict[bytes, int] = {}
        self._partial_keys: dict[int, list[bytes]] = {}
        self.pinned: list[int] = []
        self.pending_copies: list[tuple[int, int, int]] = []
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        # NOTE: the runner gathers a step's block tables from these rows with one numpy call
        # instead of converting every seq's list each step; both grow by doubling. `free_rows`
        # are the rows no live seq holds, all zero.
        self.tables = np.zeros((64, 16), dtype=np.int32)
        self.tables_version = 0  # bumped by every write to `tables`
        self.free_rows = list(range(63, -1, -1))

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
        num_blocks = (self._num_shareable(seq) - 1) // self.block_size
        hash_to_block = self.hash_to_block
        # NOTE: all of them, though the first may miss: the claims and caching of its prompt
        # blocks need them, and a seq waiting at the head of the queue is matched every step.
        hashes = self.full_block_hashes(seq, num_blocks)
        for i in range(num_blocks):
            block_id = hash_to_block.get(hashes[i])
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def match_partial(self, seq: Sequence, cached_blocks: SequenceOf[int]) -> tuple[int, int]:
        """(a cached block, n): its first n tokens are the longest run of `seq`'s tokens after
        `cached_blocks` (from match_prefix) that a cached block starts with, after the same
        prefix; (-1, 0) if none. The last token is never a hit, as in match_prefix."""
        if not self.shares_partial_blocks or not self._partial:
            return -1, 0
        bs = self.block_size
        num_blocks = len(cached_blocks)
        start = num_blocks * bs
        limit = min(bs - 1, self._num_shareable(seq) - 1 - start)
        if limit <= 0:
            return -1, 0
        parent = (
            self.full_block_hashes(seq, num_blocks)[num_blocks - 1]
            if num_blocks
            else root_hash(seq)
        )
        packed = array("q", seq.token_ids[start : start + limit]).tobytes()
        partial = self._partial
        for num_tokens in range(limit, 0, -1):
            block_id = partial.get(parent + packed[: 8 * num_tokens])
            if block_id is not None:
                return block_id, num_tokens
        return -1, 0

    def uncached_prompt_hashes(
        self, seq: Sequence, cached_blocks: SequenceOf[int], limit: int | None = None
    ) -> list[BlockHash]:
        """The chained hashes of the full blocks match_prefix could return for `seq` after its
        `cached_blocks` (at most `limit` of them): the keys those blocks will be cached under."""
        start = len(cached_blocks)
        stop = (len(seq.token_ids) - 1) // self.block_size
        if limit is not None:
            stop = min(stop, start + limit)
        return self.full_block_hashes(seq, stop)[start:stop]

    def full_block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """`seq.full_block_hashes`, the chained hashes of its leading full blocks, grown to at
        least `num_blocks` of them (all full): each block is hashed once in a seq's life."""
        hashes = seq.full_block_hashes
        start = len(hashes)
        if start < num_blocks:
            bs = self.block_size
            parent = hashes[-1] if hashes else root_hash(seq)
            # NOTE: one conversion for all the blocks; hash_block(parent, block), digest for digest.
            packed = array("q", seq.token_ids[start * bs : num_blocks * bs]).tobytes()
            width = 8 * bs
            for offset in range(0, len(packed), width):
                parent = _sha256(parent + packed[offset : offset + width]).digest()
                hashes.append(parent)
        return hashes

    def num_out_of_window(self, num_computed_tokens: int) -> int:
        """How many leading blocks of a seq with this many computed tokens no query reads again."""
        window = self.sliding_window
        if window is None or num_computed_tokens <= window:
            return 0
        return (num_computed_tokens - window) // self.block_size

    def can_allocate(
        self,
        num_new_tokens: int,
        cached_blocks: SequenceOf[int] = (),
        partial: tuple[int, int] = (-1, 0),
    ) -> bool:
        """Whether a new seq reusing `cached_blocks` and `partial` (from match_partial) can get
        blocks for `num_new_tokens` more."""
        source, num_partial = partial
        num_needed = -(-(num_partial + num_new_tokens) // self.block_size)
        num_skipped = self.num_out_of_window(len(cached_blocks) * self.block_size)
        num_revived = sum(1 for b in cached_blocks[num_skipped:] if self.ref_counts[b] == 0)
        if num_partial and self.ref_counts[source] == 0:
            num_revived += 1
        return num_needed + num_revived <= self.num_free_blocks

    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached_blocks: SequenceOf[int] = (),
        partial: tuple[int, int] = (-1, 0),
    ) -> None:
        """Admit `seq`: share `cached_blocks` (from match_prefix), then add blocks for the rest;
        cached blocks already out of the sliding window are not taken (NULL_BLOCK instead).
        With `partial` (source, n) from match_partial, the first added block is to get the
        source's first n tokens' K/V by a copy in `pending_copies`, the source pinned till then,
        and `num_new_tokens` count from after them."""
        assert not seq.block_table and seq.num_computed_tokens == 0 and seq.block_row < 0
        if not self.free_rows:
            num_rows = len(self.tables)
            self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
            self.free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        seq.block_row = self.free_rows.pop()
        source, num_partial = partial
        num_cached_tokens = len(cached_blocks) * self.block_size
        num_skipped = self.num_out_of_window(num_cached_tokens)
        ref_counts = self.ref_counts
        for block_id in cached_blocks[num_skipped:]:
            if ref_counts[block_id] == 0:
                del self.cached_free_block_ids[block_id]
            ref_counts[block_id] += 1
        seq.block_table.extend([NULL_BLOCK] * num_skipped)
        seq.block_table.extend(cached_blocks[num_skipped:])
        seq.num_dropped_blocks = num_skipped
        self._mirror(seq, 0)
        if num_partial:
            if ref_counts[source] == 0:
                del self.cached_free_block_ids[source]
            ref_counts[source] += 1
            self.pinned.append(source)
            num_cached_tokens += num_partial
        seq.num_computed_tokens = num_cached_tokens
        if seq.num_preemptions == 0:
            # NOTE: a re-admission's hits are the seq's own blocks, output tokens included.
            seq.num_cached_tokens = num_cached_tokens
        if self.enable_prefix_caching:
            self._num_registered[seq.seq_id] = len(cached_blocks)
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += num_cached_tokens
        is_allocated = self.append_slots(seq, num_new_tokens)
        assert is_allocated, "allocate() without a successful can_allocate()"
        if num_partial:
            self.pending_copies.append((source, seq.block_table[len(cached_blocks)], num_partial))

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The copies allocate() asked for since the last call; the step that admitted their
        seqs runs them before its forward pass."""
        copies = self.pending_copies
        self.pending_copies = []
        return copies

    def unpin(self) -> None:
        """Drop the references that kept the sources of taken copies; call once the step
        running them is launched (copies on a device queue before any later write)."""
        if self.pinned:
            self._release(self.pinned)
            self.pinned = []

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
        # NOTE: tail blocks first, so the LRU evicts a prompt's shareable head last.
        self._release(reversed(seq.block_table[seq.num_dropped_blocks :]))
        seq.num_dropped_blocks = 0
        if seq.block_row >= 0:
            # NOTE: zeroed so that a gathered row is 0-padded past its seq's last block.
            self.tables[seq.block_row, : len(seq.block_table)] = 0
            self.tables_version += 1
            self.free_rows.append(seq.block_row)
            seq.block_row = -1
        seq.block_table.clear()
        self._num_registered.pop(seq.seq_id, None)

    def release_out_of_window(self, seqs: Iterable[Sequence]) -> None:
        """Release the leading blocks of running `seqs` that no query will read again (every
        layer's window starts after them), with one write to `tables`; a hashed one goes to the
        LRU, as from free()."""
        window = self.sliding_window
        assert window is not None
        block_size = self.block_size
        registered = self._num_registered if self.enable_prefix_caching else None
        rows: list[int] = []
        columns: list[int] = []
        for seq in seqs:
            stop = (len(seq.token_ids) - seq.num_uncomputed_tokens - window) // block_size
            if registered is not None:
                # NOTE: a block is released only once registered, so the cache keeps every one.
                stop = min(stop, registered.get(seq.seq_id, 0))
            start = seq.num_dropped_blocks
            if stop <= start or seq.block_row < 0:
                continue
            block_table = seq.block_table
            self._release(block_table[start:stop])
            block_table[start:stop] = [NULL_BLOCK] * (stop - start)
            seq.num_dropped_blocks = stop
            rows.extend([seq.block_row] * (stop - start))
            columns.extend(range(start, stop))
        if rows:
            self.tables[rows, columns] = NULL_BLOCK
            self.tables_version += 1

    def _release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; one no seq holds becomes free, or cached-free."""
        ref_counts = self.ref_counts
        for block_id in block_ids:
            ref_counts[block_id] -= 1
            assert ref_counts[block_id] >= 0
            if ref_counts[block_id] == 0:
                if self.block_hashes[block_id] is None:
                    self.free_block_ids.append(block_id)
                else:
                    self.cached_free_block_ids[block_id] = None

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of `seq`'s blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        seq_id = seq.seq_id
        start = self._num_registered.get(seq_id, 0)
        stop = min(seq.num_computed_tokens, self._num_shareable(seq)) // self.block_size
        if stop <= start:
            return
        hashes = self.full_block_hashes(seq, stop)
        hash_to_block = self.hash_to_block
        block_hashes = self.block_hashes
        for i in range(start, stop):
            block_hash = hashes[i]
            # NOTE: an equal block cached by another seq leaves ours unhashed.
            if block_hash not in hash_to_block:
                block_id = seq.block_table[i]
                block_hashes[block_id] = block_hash
                hash_to_block[block_hash] = block_id
                if self.shares_partial_blocks:
                    self._index_partial(seq, i, hashes[i - 1] if i else root_hash(seq), block_id)
        self._num_registered[seq_id] = stop

    def _num_shareable(self, seq: Sequence) -> int:
        """How many of `seq`'s leading tokens the prefix cache may match or register."""
        if self.prompt_blocks_only:
            return min(len(seq.token_ids), seq.num_prompt_tokens)
        return len(seq.token_ids)

    def _index_partial(self, seq: Sequence, index: int, parent: BlockHash, block_id: int) -> None:
        """Key `block_id`, block `index` of `seq` just hashed, by its parent and each run of its
        leading tokens that no other cached block is keyed by."""
        bs = self.block_size
        packed = array("q", seq.token_ids[index * bs : (index + 1) * bs - 1]).tobytes()
        partial = self._partial
        keys = []
        for stop in range(8, len(packed) + 1, 8):
            key = parent + packed[:stop]
            if partial.setdefault(key, block_id) == block_id:
                keys.append(key)
        if keys:
            self._partial_keys[block_id] = keys

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
            for key in self._partial_keys.pop(block_id, ()):
                del self._partial[key]
        self.ref_counts[block_id] = 1
        return block_id
