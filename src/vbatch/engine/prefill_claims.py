"""PrefillClaims: which running seq is computing each prompt block not yet in the prefix cache
(torch-free)."""

from __future__ import annotations

from vbatch.engine.block_manager import BlockHash, BlockManager
from vbatch.engine.sequence import Sequence


class PrefillClaims:
    """Claims on uncached prompt blocks, so that a block shared by several prompts is computed once.

    Invariants: a block hash is claimed by at most one seq, a running one whose prompt is not yet
    computed; `_by_seq[seq_id]` lists exactly the hashes that seq holds in `_owners`.
    """

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self._owners: dict[BlockHash, Sequence] = {}
        self._by_seq: dict[int, list[BlockHash]] = {}  # seq_id -> the hashes it claimed

    def is_computing_next(self, seq: Sequence, cached_blocks: list[int]) -> bool:
        """Whether another seq is computing the block after `seq`'s cached ones."""
        # NOTE: so the samples of one request, and requests sharing a system prompt, compute
        # it once: the first admitted computes it, the others wait a step and hit the cache.
        if not self._owners:
            return False
        next_hashes = self.block_manager.uncached_prompt_hashes(seq, cached_blocks, limit=1)
        owner = self._owners.get(next_hashes[0]) if next_hashes else None
        return owner is not None and owner is not seq

    def claim(self, seq: Sequence, cached_blocks: list[int]) -> None:
        """Claim the uncached blocks of `seq`'s prompt that no other seq has claimed."""
        claimed = [
            block_hash
            for block_hash in self.block_manager.uncached_prompt_hashes(seq, cached_blocks)
            if self._owners.setdefault(block_hash, seq) is seq
        ]
        if claimed:
            self._by_seq[seq.seq_id] = claimed

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s claims: its prompt is computed (so cached), or it left the running set."""
        if self._by_seq:
            for block_hash in self._by_seq.pop(seq.seq_id, ()):
                del self._owners[block_hash]
