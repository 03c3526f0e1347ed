"""PagedAttention: the model's attention backend over the paged KV cache.

Each step the runner sets a ``StepContext`` (nano-vllm style: the model's forward is the
same; what attention does is decided by the context it reads). Every layer call first
writes the step's new k/v into the cache at ``slot_mapping``, then attends:

* prefill: the new tokens of B sequences (packed, ``[T]``) attend to their sequence's whole
  context read back from the cache through the block tables - this covers cached shared
  prefixes and recomputation after preemption alike. Queries are padded to ``[B, Lq]``,
  keys to ``[B, Lk]``; one SDPA call with a causal-by-position mask.
* decode: one query per sequence over its block table: torch gathers the blocks and runs one
  batched SDPA (no per-sequence loop); "triton" calls ``kernels.paged_decode``.
* "cpu": a C++ kernel (``cpu_attention``) reads the blocks in place for prefill and decode
  alike (no gather, no padding); on a CPU the gather costs more than the attention.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.generation.kv_cache import KVCache


@dataclass
class StepContext:
    """Attention metadata of one step (all on the model's device).

    slot_mapping: int64 [T] cache slot of each new token; block_tables: int32 [B, max_blocks];
    context_lens: int32 [B] tokens in cache incl. this step's; gather_idx: int64 [B*max_blocks]
    (block_tables flattened); key_mask: bool [B, 1, Lq, Lk] (True = may attend); key_pad: bool
    [B, Lk, 1, 1], True on the gathered slots past each sequence's own tokens (zeroed: a NaN
    there, another request's or a stale one, is NaN through the mask, as 0 * NaN);
    q_index: int64 [T] row of each packed query in the padded [B*Lq] layout (prefill only);
    seq_of, positions: int64 [T] sequence row and absolute position of each query ("cpu").
    Only the fields the backend reads are set (``PagedAttention.needs_mask``)."""

    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    gather_idx: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None
    key_pad: torch.Tensor | None = None
    q_index: torch.Tensor | None = None
    max_q_len: int = 1
    seq_of: torch.Tensor | None = None
    positions: torch.Tensor | None = None


class PagedAttention:
    """``attn(layer, q[T,H,Dh], k[T,Hkv,Dh], v[T,Hkv,Dh]) -> [T,H,Dh]`` (model.AttentionBackend)."""

    def __init__(self, cache: KVCache, num_heads: int, head_dim: int, decode_kernel: str = "torch"):
        self.cache, self.h, self.dh = cache, num_heads, head_dim
        self.scale = head_dim ** -0.5
        self.ctx: StepContext | None = None
        self._triton = self._cpu = self._write = None
        if decode_kernel == "cpu":
            if cache.k[0].device.type != "cpu":
                raise ValueError("engine.attention_backend 'cpu' needs device 'cpu'")
            from workers.generation import cpu_attention, cpu_ops

            cpu_attention.load()  # build now (clear error at construction, not mid-step)
            self._cpu, self._write = cpu_attention.paged_attention, cpu_ops.load().write_kv
        elif decode_kernel == "triton":
            try:
                from workers.generation import kernels_package

                kernels = kernels_package.load()
                from kernels import paged_decode
            except ImportError as e:
                raise ValueError(f"engine.attention_backend 'triton' needs kernels.paged_decode: {e}") from e
            device = cache.k[0].device
            if not kernels.triton_usable(device):
                raise ValueError(f"engine.attention_backend 'triton' cannot run on {device}: needs triton "
                                 "(pip install -e .[kernels]) and CUDA (or TRITON_INTERPRET=1); use 'torch'")
            self._triton = paged_decode.paged_decode_attention

    @property
    def uses_cpu_kernel(self) -> bool:
        return self._cpu is not None

    def needs_mask(self, is_prefill: bool) -> bool:
        """Whether the step context must carry gather indices and the padded key mask."""
        return self._cpu is None and (is_prefill or self._triton is None)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        hkv = kc.shape[2]
        if self._cpu is not None:
            self._write(kc, vc, k, v, ctx.slot_mapping)
            return self._cpu(q, kc, vc, ctx.block_tables, ctx.seq_of, ctx.positions, self.scale)
        kc.view(-1, hkv, self.dh).index_copy_(0, ctx.slot_mapping, k.to(kc.dtype))
        vc.view(-1, hkv, self.dh).index_copy_(0, ctx.slot_mapping, v.to(vc.dtype))
        if not ctx.is_prefill and self._triton is not None:
            return self._triton(q, kc, vc, ctx.block_tables, ctx.context_lens, self.scale)
        b = ctx.context_lens.shape[0]
        nb = kc.shape[0]
        keys = kc.view(nb, -1).index_select(0, ctx.gather_idx).view(b, -1, hkv, self.dh)  # [B, Lk, Hkv, Dh]
        vals = vc.view(nb, -1).index_select(0, ctx.gather_idx).view(b, -1, hkv, self.dh)
        if keys.dtype != q.dtype:  # a 16-bit cache (kv_cache_dtype) under a wider model
            keys, vals = keys.to(q.dtype), vals.to(q.dtype)
        keys.masked_fill_(ctx.key_pad, 0.0), vals.masked_fill_(ctx.key_pad, 0.0)  # (fresh copies: the gather)
        if ctx.is_prefill:
            qp = q.new_zeros(b * ctx.max_q_len, self.h, self.dh).index_copy_(0, ctx.q_index, q)
            qp = qp.view(b, ctx.max_q_len, self.h, self.dh)  # [B, Lq, H, Dh]
        else:
            qp = q[:, None]  # [B, 1, H, Dh]
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=ctx.key_mask,
            scale=self.scale, enable_gqa=self.h != hkv)  # [B, H, Lq, Dh]
        out = out.transpose(1, 2)  # [B, Lq, H, Dh]
        if ctx.is_prefill:
            return out.reshape(-1, self.h, self.dh).index_select(0, ctx.q_index)
        return out[:, 0]
