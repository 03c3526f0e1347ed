"""KVCache: the paged K/V tensors of every layer (layout of contract 1)."""
from __future__ import annotations

import torch


class KVCache:
    """Per layer ``k[layer], v[layer]: [num_blocks, block_size, num_kv_heads, head_dim]``."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` becomes a copy of block ``src`` in every layer."""
        if not copies:
            return
        dev = self.k[0].device
        idx = torch.tensor(copies, dtype=torch.int64)  # [N, 2] (src, dst)
        if dev.type == "cuda":
            idx = idx.pin_memory().to(dev, non_blocking=True)
        src, dst = idx[:, 0], idx[:, 1]
        for cache in (*self.k, *self.v):
            cache.index_copy_(0, dst, cache.index_select(0, src))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
