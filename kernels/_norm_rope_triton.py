"""Triton kernels behind ``kernels.rmsnorm`` and ``kernels.rotary`` (imported lazily).

Both are one-pass, memory-bound row kernels: each reads its input once and writes once, where
the eager torch versions launch ~5 kernels and round to bf16 between them. fp32 math inside.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import KernelCall


@triton.jit
def _rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps,
              stride_x, stride_r, stride_o, stride_ro,
              D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RES: tl.constexpr):
    """One row per program: h = x (+ residual, rounded to x's dtype); out = w * (h * rms^-1)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + offs, mask=mask,
                                        other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    # like the model's RMSNorm: normalise in fp32, round to x's dtype, then scale by weight
    y = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary(x_ptr, cos_ptr, sin_ptr, out_ptr,
            stride_xt, stride_xh, stride_ct, stride_st, stride_ot, stride_oh,
            H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One token per program, all heads: out = x * cos + rotate_half(x) * sin (HF convention:
    rotate_half(x) = cat(-x2, x1) for halves x1, x2)."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    m = (offs_h[:, None] < H) & (offs_d[None, :] < HALF)
    dm = offs_d < HALF
    base = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_HALF]
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_ct + offs_d, mask=dm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + offs_d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_st + offs_d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_st + HALF + offs_d, mask=dm, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    ty = out_ptr.dtype.element_ty
    tl.store(out, (x1 * c1 - x2 * s1).to(ty), mask=m)
    tl.store(out + HALF, (x2 * c2 + x1 * s2).to(ty), mask=m)


def rms_norm_plan(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, KernelCall]:
    """x, residual: [T, D] (last dim contiguous); weight: [D] -> (out, x + residual, launch)."""
    rows, dim = x.shape
    out = torch.empty(rows, dim, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    res_out = torch.empty_like(x) if residual is not None else None
    res, ro = (residual, res_out) if residual is not None else (x, out)  # placeholders
    call = KernelCall(_rms_norm, (rows,),
                      (x, res, weight, out, ro, float(eps),
                       x.stride(0), res.stride(0), out.stride(0), ro.stride(0)),
                      dict(D=dim, BLOCK_D=triton.next_power_of_2(dim), HAS_RES=residual is not None),
                      dict(num_warps=4 if dim <= 4096 else 8))
    return out, res_out, call


def rotary_plan(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, KernelCall]:
    """x: [T, H, Dh] (last dim contiguous); cos, sin: [T, Dh] -> (out, launch)."""
    tokens, heads, head_dim = x.shape
    out = torch.empty_like(x)
    call = KernelCall(_rotary, (tokens,),
                      (x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                       out.stride(0), out.stride(1)),
                      dict(H=heads, HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(heads),
                           BLOCK_HALF=triton.next_power_of_2(head_dim // 2)))
    return out, call


def rms_norm(x, weight, eps, residual):
    out, res_out, call = rms_norm_plan(x, weight, eps, residual)
    call()
    return out, res_out


def rotary(x, cos, sin):
    out, call = rotary_plan(x, cos, sin)
    call()
    return out
