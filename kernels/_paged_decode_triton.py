"""Triton kernels behind ``kernels.paged_decode`` (imported lazily: see kernels/__init__.py).

Two kernels, split-K style (flash-decoding):

* ``_paged_decode_partial``, grid ``(B, Hkv, num_splits)``: one program reads one KV head's
  share of one sequence through the block table, tile by tile (``BLOCK_N`` tokens): each
  sequence's own context is cut into ``num_splits`` pieces of whole tiles, none shorter than
  ``min_split_tokens`` (a short sequence fills fewer pieces; the programs past its end exit).
  Pieces follow the lengths read on the device, not the block table's width, so a ragged
  batch or a table sized for ``max_model_len`` (CUDA graphs) still spreads every sequence
  over the splits. Each program computes *all* ``GROUP = H / Hkv`` query
  heads of that KV head against it with an online softmax. Each K/V byte is read once per KV
  head, not once per query head: that is what makes GQA decode bandwidth-efficient. The
  query-head group is padded to ``BLOCK_G >= 16`` rows so both ``tl.dot`` calls have every dim
  >= 16 (what GPU compilation requires); padded rows are masked on load and store.
  With one split it writes the final output; otherwise the split's normalised output and its
  log-sum-exp (base 2).
* ``_paged_decode_reduce``, grid ``(B, H)``: combines the splits by their log-sum-exp.

Scores are kept in base 2 (``exp2``/``log2``, scale folded with log2(e)); fp32 throughout
except the ``tl.dot`` operands, which are upcast to fp32 when ``UPCAST`` (the interpreter's
bf16 dot is wrong) and stay in the cache's 16-bit dtype on GPU. fp32 dots use
``input_precision="ieee"`` (no TF32): decode is bandwidth-bound, and fp32 caches ask for fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import KernelCall

LOG2E = 1.4426950408889634


@triton.jit
def _paged_decode_partial(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, o_ptr, lse_ptr,
    qk_scale, min_split_tokens,
    stride_qb, stride_qh, stride_qd,
    stride_kn, stride_kt, stride_kh, stride_kd,
    stride_vn, stride_vt, stride_vh, stride_vd,
    stride_btb,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    ctx = tl.load(lens_ptr + b)
    per = tl.cdiv(tl.cdiv(ctx, tl.num_programs(2)), BLOCK_N) * BLOCK_N  # whole tiles
    piece = tl.maximum(per, min_split_tokens)
    start = split * piece
    end = tl.minimum(start + piece, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g  # [BLOCK_G]

    # q: [BLOCK_G, BLOCK_D]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    bt_row = bt_ptr + b * stride_btb
    # the K/V offsets in int64: a cache of 2**31 elements or more laid out head- or dim-major (its
    # shape the same) made kvh * stride_kh wrap in int32 and read other memory (review, s53)
    kvh64 = kvh.to(tl.int64)
    offs_d64 = offs_d.to(tl.int64)
    for t0 in range(start, end, BLOCK_N):
        toks = t0 + offs_n  # [BLOCK_N]
        t_mask = toks < end
        blk = tl.load(bt_row + toks // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        slot = (toks % BLOCK_SIZE).to(tl.int64)
        # kT: [BLOCK_D, BLOCK_N], loaded transposed; v: [BLOCK_N, BLOCK_D]
        kt = tl.load(k_ptr + blk[None, :] * stride_kn + slot[None, :] * stride_kt
                     + kvh64 * stride_kh + offs_d64[:, None] * stride_kd,
                     mask=d_mask[:, None] & t_mask[None, :], other=0.0)
        v = tl.load(v_ptr + blk[:, None] * stride_vn + slot[:, None] * stride_vt
                    + kvh64 * stride_vh + offs_d64[None, :] * stride_vd,
                    mask=t_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, kt, input_precision="ieee") * qk_scale  # [BLOCK_G, BLOCK_N], base-2 logits
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has a valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    has = l_i > 0.0  # false for a split past the end of the sequence
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    o_base = o_ptr + b * stride_ob + split * stride_os
    tl.store(o_base + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
             out.to(o_ptr.dtype.element_ty), mask=o_mask)
    if WRITE_LSE:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _paged_decode_reduce(
    o_part_ptr, lse_ptr, out_ptr,
    num_splits,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM

    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))  # [BLOCK_S]
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # empty sequence: all weights 0, output 0
    w = tl.exp2(lse - m)
    o = tl.load(o_part_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps
                + offs_d[None, :] * stride_pd, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    num = tl.sum(w[:, None] * o, axis=0)  # [BLOCK_D]
    den = tl.sum(w, axis=0)
    out = num / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
         cfg) -> tuple[torch.Tensor, list[KernelCall]]:
    """Allocate the output (and split buffers) and list the launches for ``cfg`` (a
    ``paged_decode.DecodeLaunch``). Works on the meta device, for ``compile_check``."""
    bsz, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    splits = cfg.num_splits
    if splits == 1:
        o_part, lse = out.unsqueeze(2), out  # [B, H, 1, Dh]; lse unused
    else:
        o_part = torch.empty(bsz, num_heads, splits, head_dim, device=q.device, dtype=torch.float32)
        lse = torch.empty(bsz, num_heads, splits, device=q.device, dtype=torch.float32)
    calls = [KernelCall(
        _paged_decode_partial, (bsz, num_kv_heads, splits),
        (q, k_cache, v_cache, block_tables, context_lens, o_part, lse,
         scale * LOG2E, cfg.min_split_tokens,
         *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0),
         *o_part.stride(), lse.stride(0), lse.stride(1)),
        dict(GROUP=num_heads // num_kv_heads, BLOCK_G=cfg.block_g, HEAD_DIM=head_dim,
             BLOCK_D=cfg.block_d, BLOCK_SIZE=k_cache.shape[1], BLOCK_N=cfg.block_n,
             UPCAST=cfg.upcast, WRITE_LSE=splits > 1),
        dict(num_warps=cfg.num_warps))]
    if splits > 1:
        calls.append(KernelCall(
            _paged_decode_reduce, (bsz, num_heads),
            (o_part, lse, out, splits,
             *o_part.stride(), lse.stride(0), lse.stride(1), *out.stride()),
            dict(HEAD_DIM=head_dim, BLOCK_D=cfg.block_d, BLOCK_S=triton.next_power_of_2(splits))))
    return out, calls


def launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
           cfg) -> torch.Tensor:
    """Run the kernels with launch choices ``cfg``. q: [B, H, Dh] -> out: [B, H, Dh] (q's dtype)."""
    out, calls = plan(q, k_cache, v_cache, block_tables, context_lens, scale, cfg)
    for call in calls:
        call()
    return out
