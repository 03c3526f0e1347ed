"""Panel GEMMs for fp32 on AVX-512 CPUs: the engine's CPU forward multiplies against weights
packed once into column panels, by a small C++ kernel (``csrc/panel_gemm.cpp``, compiled on
first use, ``cpp_build``).

A weight ``[N, K]`` is packed as ``[ceil(N / 32), K, 32]``: panel ``p`` holds columns
``32p .. 32p + 31`` (zeros past ``N``), its row ``k`` the 32 weights that multiply ``x[:, k]``,
so the kernel streams a panel front to back. A tile of 6 rows x 64 columns keeps 24
accumulators in registers; per ``k`` it loads 4 panel vectors and broadcasts 6 inputs. Work
items are (64 output columns, up to 96 rows), over torch's intra-op threads. The tile's
epilogue adds a bias and a residual (``add``), masks the last panel's missing columns, and
can do two more things, each saving the forward a whole op:

* ``swiglu``: gate and up panels interleaved (``pack_swiglu``), one tile holds 32 gate and the
  same 32 up columns and writes ``silu(gate) * up``; the ``[M, 2I]`` projection is never written;
* a folded RMSNorm (``pack(..., norm=(g, eps))``): ``rms_norm(x, g) @ W.T`` is
  ``(1 / rms(x)) * (x @ (W * g).T)``, so ``g`` is multiplied into the panels at packing and
  each row's ``1 / rms`` is computed by the work item and applied in the epilogue.

Why not oneDNN's prepacked GEMM (``prepacked.py``, kept for bf16/fp16): at decode sizes each
of its calls pays ~20 us of fixed cost (17 calls a step in workload (a)), and its fp32 kernels
ran slower than this tile at (a)'s shapes at every row count measured (``bench/cpu_gemm.py``:
1.4-3.5x; at Qwen2.5-0.5B's shapes 0.97-1.7x). Each output row is computed in one k order
whatever the number of rows: a row's result does not depend on the rows beside it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from workers.generation.cpp_build import build, csrc

_SOURCE = csrc("vexp.h", "panel_gemm.cpp")


@dataclass(frozen=True)
class Panels:
    """A weight ``[n, K]`` packed for ``linear`` (``data``: ``[ceil(n / 32), K, 32]``), or
    (``gated``) gate and up weights ``[n, K]`` each packed for ``swiglu``. ``rms_eps`` (not
    None): an RMSNorm's weight was folded into the panels (``W * g``), and each input row is
    normalised with this eps inside the GEMM: ``rms_norm(x, g) @ W.T`` without a normalised copy
    of ``x``."""
    data: torch.Tensor
    n: int
    gated: bool = False
    rms_eps: float | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """The packed weight's ``[N, K]`` (gate and up together: ``[2n, K]``)."""
        return (2 if self.gated else 1) * self.n, self.data.shape[1]


def _load():
    return build("streamrl_panel_gemm", _SOURCE, ("pack", "linear", "swiglu"), "panel GEMM (engine.cpu_prepack)")


def available(dtype: torch.dtype) -> bool:
    """Whether panel GEMMs run here for ``dtype``: fp32 on an AVX-512 CPU, the extension built,
    and a probe product right."""
    return dtype == torch.float32 and "AVX512" in torch.backends.cpu.get_cpu_capability() and _probe()


@cache
def _probe() -> bool:
    try:
        w = torch.arange(40 * 16, dtype=torch.float32).reshape(40, 16).div_(640)
        x = torch.ones(3, 16)
        got = linear(x, pack(w), None)
    except RuntimeError:
        return False
    return torch.allclose(got, x @ w.t(), rtol=1e-5, atol=1e-5)


def preferred(dtype: torch.dtype) -> bool:
    """Where they run, the engine's CPU forward uses them (``FusedForward``)."""
    return available(dtype)


def _folded(w: torch.Tensor, norm: tuple[torch.Tensor, float] | None) -> torch.Tensor:
    w = w.detach()
    if norm is None:
        return w
    g = norm[0].detach()
    if g.shape != (w.shape[1],):
        raise ValueError(f"panel_gemm: a norm weight of shape {tuple(g.shape)} cannot fold into a weight "
                         f"[{w.shape[0]}, {w.shape[1]}] (it must be [{w.shape[1]}])")
    return w * g


def pack(weight: torch.Tensor, batch_hint: int | None = None,
         norm: tuple[torch.Tensor, float] | None = None) -> Panels:
    """``weight`` [N, K] packed into panels; ``norm`` = (RMSNorm weight [K], eps): fold that
    norm of the input in (see ``Panels``). ``batch_hint``: unused (the panel layout is the same
    for every row count), taken for the signature ``prepacked.pack`` has."""
    return Panels(_load().pack(_folded(weight, norm)), weight.shape[0], rms_eps=None if norm is None else norm[1])


def linear(x: torch.Tensor, packed: Panels, bias: torch.Tensor | None,
           add: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias) (+ add)`` for ``packed = pack(W)`` (``rms_norm(x) @ W.T ...`` when a
    norm was folded in); ``add`` [M, N] (a residual)."""
    eps = -1.0 if packed.rms_eps is None else packed.rms_eps
    return _load().linear(x, packed.data, packed.n, bias, add, eps)


def pack_swiglu(gate: torch.Tensor, up: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None) -> Panels:
    """Gate and up weights ``[I, K]`` packed for ``swiglu``: their panels interleaved (gate
    panel p, then up panel p), so one tile computes both halves of its 32 columns; ``norm``
    as in ``pack``."""
    g, u = _load().pack(_folded(gate, norm)), _load().pack(_folded(up, norm))
    return Panels(torch.stack((g, u), dim=1).flatten(0, 1), gate.shape[0], gated=True,
                  rms_eps=None if norm is None else norm[1])


def swiglu(x: torch.Tensor, packed: Panels, bias: torch.Tensor | None) -> torch.Tensor:
    """``silu(x @ Wg.T + bg) * (x @ Wu.T + bu)`` [M, I] for ``packed = pack_swiglu(Wg, Wu)``
    (of ``rms_norm(x)`` when a norm was folded in); ``bias``: the gate and up biases
    concatenated ([2I]) or None. The SwiGLU is the GEMM's epilogue: the [M, 2I] projection is
    never written."""
    eps = -1.0 if packed.rms_eps is None else packed.rms_eps
    return _load().swiglu(x, packed.data, packed.n, bias, eps)
