"""BlockManager: the paged KV cache's bookkeeping (which block holds which tokens).

The cache is ``num_blocks`` fixed-size blocks of ``block_size`` token slots. A sequence owns
a block table (list of block ids); token ``i`` lives in slot
``block_table[i // block_size] * block_size + i % block_size``. Blocks are reference-counted
so the samples of one prompt can share its blocks (see ``PrefixCache``); a shared block is
copied before it is written (copy-on-write). Pure Python: the tensors live in ``KVCache``.
"""
from __future__ import annotations

from collections import deque

from workers.generation.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self._free = deque(range(num_blocks))
        self.peak = 0  # most blocks in use at once since ``reset_peak``

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def reset_peak(self) -> None:
        self.peak = self.num_used

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        b = self._free.popleft()
        self.ref[b] = 1
        self.peak = max(self.peak, self.num_blocks - len(self._free))
        return b

    def decref(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self._free.append(b)
            elif self.ref[b] < 0:
                raise RuntimeError(f"block {b} freed twice")

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] += 1

    def new_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to allocate (growth + copy-on-write) so ``seq`` can write tokens
        ``[seq.num_cached, num_tokens)``."""
        grow = max(0, self.blocks_for(num_tokens) - len(seq.block_table))
        first = seq.num_cached // self.block_size
        cow = int(first < len(seq.block_table) and self.ref[seq.block_table[first]] > 1)
        return grow + cow

    def prepare_write(self, seq: Sequence, num_tokens: int) -> tuple[int, int] | None:
        """Grow ``seq``'s table to hold ``num_tokens`` and make the block of its first
        uncached token private. Returns the (src, dst) block copy to do in the cache, or None.
        The caller checked ``new_blocks_needed <= num_free``."""
        copy = None
        first = seq.num_cached // self.block_size
        if first < len(seq.block_table) and self.ref[seq.block_table[first]] > 1:
            src = seq.block_table[first]
            dst = self._take()
            self.decref([src])
            seq.block_table[first] = dst
            copy = (src, dst)
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self._take())
        return copy

    def share(self, seq: Sequence, blocks: list[int]) -> None:
        """Start ``seq``'s table with (shared) ``blocks``."""
        assert not seq.block_table
        self.incref(blocks)
        seq.block_table = list(blocks)

    def free(self, seq: Sequence) -> None:
        self.decref(seq.block_table)
        seq.block_table = []
        seq.num_cached = 0

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size
