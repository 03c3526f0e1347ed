"""BlockManager: the paged KV cache's bookkeeping (which block holds which tokens).

The cache is ``num_blocks`` fixed-size blocks of ``block_size`` token slots. A sequence owns
a block table (list of block ids); token ``i`` lives in slot
``block_table[i // block_size] * block_size + i % block_size``. Blocks are reference-counted
so the samples of one prompt can share its blocks (see ``PrefixCache``); a shared block is
copied before it is written (copy-on-write). Pure Python: the tensors live in ``KVCache``.

Automatic prefix caching (``caching``, vLLM's ``enable_prefix_caching``): a full block whose
K/V is written is registered under a chained hash of its tokens (``block_hashes``: the
block's token ids and the previous block's hash, so its position too; SHA-256, as vLLM's default
``prefix_caching_hash_algo``: a collision would hand a sequence another prefix's K/V silently,
and Python's 64-bit ``hash`` makes one likely enough over a long run's millions of blocks to
matter). A freed block with a
hash keeps its contents and goes to an LRU set of evictable blocks (counted as free) instead
of the plain free list; ``match`` shares the longest run of a sequence's leading full blocks
found by hash; allocation takes plain free blocks first, then evicts the least recently
freed cached block (dropping its hash). A full block is never written again, so a block
shared by hash is read-only and needs no copy-on-write.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from workers.generation.sequence import Sequence


# ``seq.num_hashed`` of a sequence whose K/V is of weights changed in place since: it registers no
# more blocks (until ``free`` resets it, when it is recomputed)
NEVER_REGISTER = 1 << 62


def block_hashes(seq: Sequence, n: int, block_size: int) -> list[bytes]:
    """The chained hashes of ``seq``'s first ``n`` full blocks of tokens (kept on ``seq``:
    each block is hashed once per sequence): SHA-256 of the previous block's digest and the
    block's token ids as int64."""
    hs, toks, bs = seq.block_hashes, seq.tokens, block_size
    prev = hs[-1] if hs else b""
    for i in range(len(hs), n):
        prev = hashlib.sha256(prev + array("q", toks[i * bs:(i + 1) * bs]).tobytes()).digest()
        hs.append(prev)
    return hs


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, caching: bool = False):
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, caching
        self.ref = [0] * num_blocks
        self._free = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; oldest first
        self._hash_of: dict[int, bytes] = {}  # block -> hash
        self._block_of: dict[bytes, int] = {}  # hash -> block
        self.peak = 0  # most blocks in use at once since ``reset_peak``

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def reset_peak(self) -> None:
        self.peak = self.num_used

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:  # evict the least recently freed cached block
            b, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(b)]
        self.ref[b] = 1
        return b

    def decref(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
            elif self.ref[b] < 0:
                raise RuntimeError(f"block {b} freed twice")

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:  # a cached block reused: no longer evictable
                del self._evictable[b]
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
        # the peak is taken where a table is committed: a cached block a waiting sequence matched
        # and gave back when it did not fit was never in use (it read 100% for 75%; review, s54)
        self.peak = max(self.peak, self.num_used)
        return copy

    def share(self, seq: Sequence, blocks: list[int]) -> None:
        """Start ``seq``'s table with (shared) ``blocks``."""
        assert not seq.block_table
        self.incref(blocks)
        seq.block_table = list(blocks)

    def free(self, seq: Sequence) -> None:
        self.decref(seq.block_table)
        seq.block_table = []
        seq.num_cached = seq.num_hashed = 0

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    # ---- prefix caching ------------------------------------------------------------------
    def match(self, seq: Sequence) -> int:
        """Start ``seq`` (no blocks yet) on the longest run of its leading full blocks found by
        hash, never all its tokens (the last one is computed: its logits give the next
        token). Returns the tokens found; ``seq.num_cached`` is set to them (``free`` undoes
        it)."""
        assert not seq.block_table
        n = (seq.num_tokens - 1) // self.block_size
        if not self.caching or n == 0 or not self._block_of:
            return 0
        blocks = []
        for h in block_hashes(seq, n, self.block_size):
            b = self._block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        if blocks:
            self.share(seq, blocks)
            seq.num_cached = len(blocks) * self.block_size
            seq.num_hashed = len(blocks)
        return seq.num_cached

    def register(self, seq: Sequence) -> None:
        """After a step that completed: hash ``seq``'s blocks that are full of written K/V
        (``num_cached`` tokens) and not hashed yet. A hash already held by another block keeps
        that block (this one stays unhashed, a plain block when freed)."""
        n = seq.num_cached // self.block_size
        if n <= seq.num_hashed:
            return
        hs = block_hashes(seq, n, self.block_size)
        table, hash_of, block_of = seq.block_table, self._hash_of, self._block_of
        for i in range(seq.num_hashed, n):
            b, h = table[i], hs[i]
            if b not in hash_of and h not in block_of:
                hash_of[b], block_of[h] = h, b
        seq.num_hashed = n

    def drop_hashes(self) -> None:
        """Forget every hash (new weights: the cached K/V is of the old ones); evictable
        blocks become plain free blocks."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_of.clear()
        self._block_of.clear()
