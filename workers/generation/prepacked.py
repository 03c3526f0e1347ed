"""oneDNN prepacked GEMMs for the engine's CPU forward (``FusedForward``).

A linear layer's weight is reordered once, when the weights change, into oneDNN's blocked
layout for this CPU (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's CPU freezing
pass does), and every step multiplies against that (``_linear_pointwise``). A plain ``[N, K]``
weight is re-laid-out inside each call instead; at decode batch sizes that costs as much as
the arithmetic. Measured on a 2-core AVX512-BF16 VM (docs/engine.md, "Prepacked GEMMs"): a
decode step's GEMMs at Qwen2.5-0.5B shapes and 16 rows, bf16 84 -> 48 ms, fp32 291 -> 107 ms;
the tiny model of workload (a) at 64 rows, fp32, 2.4 -> 2.0 ms.

``available(dtype)`` probes whether this torch build and CPU run it for ``dtype`` (x86 builds
of torch carry oneDNN; bf16 needs AVX512-BF16 or AMX there). ``preferred(dtype)``, what the
forward uses by default, asks an AVX-512 CPU as well: with oneDNN held to AVX2 on the same VM
(``ONEDNN_MAX_CPU_ISA=AVX2``, MKL likewise), fp32 prepacked GEMMs were 6% slower than the
plain ones at workload (a)'s shapes (2.96 -> 3.14 ms a step) and 18% faster at 0.5B's, so
AVX2 CPUs keep the plain GEMMs they were tuned on."""
from __future__ import annotations

from functools import cache

import torch


@cache
def available(dtype: torch.dtype) -> bool:
    """Whether a prepacked ``dtype`` GEMM runs here (and gives the right numbers)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16).div_(512).to(dtype)
        x = torch.ones(2, 16, dtype=dtype)
        got = linear(x, pack(w, 2), None)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return torch.allclose(got.float(), (x.float() @ w.float().t()), rtol=2e-2, atol=2e-2)


def preferred(dtype: torch.dtype) -> bool:
    """Whether ``FusedForward`` prepacks by default: where it runs, on an AVX-512 CPU."""
    return "AVX512" in torch.backends.cpu.get_cpu_capability() and available(dtype)


def pack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """``weight`` [N, K] in oneDNN's layout for GEMMs of about ``batch_hint`` rows (any row
    count works; the hint picks the blocking)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
           add: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias) (+ add)`` for ``packed`` = ``pack(W)``; ``add`` [M, N] (a residual)
    is fused into the GEMM's output."""
    if add is None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, add, packed, bias, "add")
