"""Fused RMSNorm (with optional residual add) and rotary embedding, Triton + torch references.

Numerics follow ``workers.model``: ``RMSNorm`` normalises in fp32, rounds to the input dtype,
then multiplies by the weight; ``apply_rotary`` is HF's rotate-half convention. The Triton
versions take x's dtype for every input (a residual or cos/sin of another dtype is refused:
the references would promote to it, the kernels round to x's) and do each in one pass (fp32
inside, one rounding at the end), so 16-bit results may differ from the eager torch ones by
an ulp. Not wired into the model (its forward is shared with the trainer); they are here for
the decode path once measured to pay on a GPU (bench/kernels.py).
"""
from __future__ import annotations

import torch

from kernels import interpreter_mismatch, triton_usable
from kernels.paged_decode import DTYPES


def _require_triton(x: torch.Tensor, what: str) -> None:
    if not triton_usable(x.device):
        raise RuntimeError(f"{what}: triton cannot run on {x.device} (needs triton and CUDA, "
                           "or TRITON_INTERPRET=1); use the *_ref function")
    if (why := interpreter_mismatch()) is not None:
        raise RuntimeError(f"{what}: {why}")


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """x: [T, D], weight: [D] -> out [T, D]; with ``residual`` [T, D] returns
    ``(rms_norm(x + residual), x + residual)`` (the sum in x's dtype, as the model adds)."""
    h = x if residual is None else x + residual
    y = h.float()
    y = weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return y if residual is None else (y, h)


def _check_float(op: str, **tensors: torch.Tensor) -> None:
    """The kernels compute in floating point: an integer tensor would come back truncated."""
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise ValueError(f"{op}: {name} has dtype {t.dtype}; expected one of "
                             f"{', '.join(str(d) for d in DTYPES)}")


def _same_device(op: str, **tensors: torch.Tensor | None) -> None:
    """A ValueError naming each tensor's device when they are not all on one."""
    devs = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devs.values())) > 1:
        raise ValueError(f"{op}: inputs on several devices: " + ", ".join(f"{k} on {v}" for k, v in devs.items()))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """Triton version of ``rms_norm_ref`` (same signature and results)."""
    if x.dim() != 2 or weight.shape != (x.shape[1],) or x.stride(-1) != 1:
        raise ValueError(f"rms_norm: x must be [T, D] with a contiguous last dim and weight [D]; "
                         f"got x {tuple(x.shape)} stride {x.stride()}, weight {tuple(weight.shape)}")
    _check_float("rms_norm", x=x, weight=weight)
    if weight.stride(0) != 1:  # the kernel reads it as contiguous
        raise ValueError(f"rms_norm: weight must be contiguous, got stride {weight.stride()}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1
                                 or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual must match x ({tuple(x.shape)} {x.dtype}, contiguous last dim), got "
                         f"{tuple(residual.shape)} {residual.dtype} stride {residual.stride()}")
    _same_device("rms_norm", x=x, weight=weight, residual=residual)
    _require_triton(x, "rms_norm")
    from kernels import _norm_rope_triton

    out, res = _norm_rope_triton.rms_norm(x, weight, eps, residual)
    return out if residual is None else (out, res)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, Dh]; cos, sin: [T, Dh] -> x * cos + rotate_half(x) * sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton version of ``rotary_ref`` (one pass over x, all heads of a token per program)."""
    if x.dim() != 3 or x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"rotary: x must be [T, H, Dh] with even Dh and a contiguous last dim, "
                         f"got {tuple(x.shape)} stride {x.stride()}")
    _check_float("rotary", x=x)
    want = (x.shape[0], x.shape[2])
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want or t.stride(-1) != 1 or t.dtype != x.dtype:
            raise ValueError(f"rotary: {name} must be [T, Dh] = {list(want)} in x's dtype {x.dtype} with a "
                             f"contiguous last dim, got {tuple(t.shape)} {t.dtype} stride {t.stride()}")
    _same_device("rotary", x=x, cos=cos, sin=sin)
    _require_triton(x, "rotary")
    from kernels import _norm_rope_triton

    return _norm_rope_triton.rotary(x, cos, sin)


__all__ = ["rms_norm", "rms_norm_ref", "rotary", "rotary_ref"]
