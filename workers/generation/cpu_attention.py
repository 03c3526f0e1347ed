"""Paged attention for the CPU: a small C++ kernel (``csrc/paged_attention.cpp``), compiled on
first use (torch cpp_extension).

Attention backend "cpu" of the native engine. Each query token ``i`` (sequence ``seq_of[i]``,
absolute position ``positions[i]``) attends to keys ``[0, positions[i]]`` of its sequence,
read straight from the paged cache through the block table: no gather copy, no padding, no
mask, decode and prefill (with cached prefixes) alike. Work is split
over query tokens (and over KV heads when there are fewer tokens than 2 per thread) with
``at::parallel_for`` (torch's intra-op threads); one pass over a sequence's blocks, each
scored, softmaxed online (flash-decoding style) and accumulated in fp32; fp32, bf16 and
fp16 caches. Why: with torch
ops, decode attention over a paged cache has to gather each sequence's blocks into a padded
copy first, which on a CPU costs more than the
attention itself (see docs/engine.md). The build (~1 min, once per kind of CPU: cached under
``~/.cache/torch_extensions``, by instruction set, ``cpp_build``) needs a C++ compiler.
"""
from __future__ import annotations

import torch

from workers.generation.cpp_build import build, csrc

_SOURCE = csrc("vexp.h", "paged_attention.cpp")


def load():
    """The compiled extension (built on first call, then cached on disk and in memory)."""
    return build("streamrl_paged_attention_cpu", _SOURCE, ("paged_attention",), "engine.attention_backend 'cpu'")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_of: torch.Tensor, positions: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q: [T, H, Dh]; caches: [num_blocks, block_size, Hkv, Dh]; block_tables: int32 [B, M];
    seq_of, positions: int64 [T] -> out [T, H, Dh]. Token i attends to keys 0..positions[i]
    of sequence seq_of[i] (its own k/v must already be in the cache). q may be a row-strided
    view (e.g. of a fused qkv projection): only each token's [H, Dh] must be contiguous."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    # (the kernel reads them as contiguous: a strided view, e.g. a column of a [T, 2] index, read
    # other values)
    return load().paged_attention(q, k_cache, v_cache, block_tables, seq_of.contiguous(), positions.contiguous(),
                                  scale)
