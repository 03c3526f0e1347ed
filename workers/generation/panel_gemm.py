"""Panel GEMMs for fp32 on AVX-512 CPUs: the engine's CPU forward multiplies against weights
packed once into column panels, by a small C++ kernel (compiled on first use, ``cpp_build``).

A weight ``[N, K]`` is packed as ``[ceil(N / 32), K, 32]``: panel ``p`` holds columns
``32p .. 32p + 31`` (zeros past ``N``), its row ``k`` the 32 weights that multiply ``x[:, k]``,
so the kernel streams a panel front to back. A tile of 6 rows x 64 columns keeps 24
accumulators in registers; per ``k`` it loads 4 panel vectors and broadcasts 6 inputs. Work
items are (64 columns, up to 96 rows), over torch's intra-op threads. Bias and a residual
(``add``) are added in the tile's epilogue; the last panel's missing columns are masked.

Why not oneDNN's prepacked GEMM (``prepacked.py``, kept for bf16): at decode sizes each of
its calls pays ~20 us of fixed cost (17 calls a step in workload (a)), and its fp32 kernels
ran slower than this one at every decode size measured (2 threads, the five GEMM shapes of
workload (a)'s layer plus lm_head, weights evicted first: 64 rows 1,121 -> 765 us, 8 rows
647 -> 250 us; docs/engine.md). Each output row is computed the same way whatever the
number of rows (no blocking that depends on M): a row's result does not depend on its batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from workers.generation.cpp_build import VEXP, build

PANEL = 32  # columns per panel

_SOURCE = VEXP + r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>

constexpr int64_t PANEL = 32, ROWS = 6, CHUNK = 96;  // tile rows; rows per work item

torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "panel_gemm.pack: the weight must be a 2-D fp32 CPU tensor, got ", w.sizes(), " ", w.scalar_type());
  const auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), NP = (N + PANEL - 1) / PANEL;
  auto p = torch::zeros({NP, K, PANEL}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = p.data_ptr<float>();
  at::parallel_for(0, NP, 1, [&](int64_t a, int64_t b) {
    for (int64_t q = a; q < b; ++q)
      for (int64_t j = 0; j < PANEL && q * PANEL + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(q * K + k) * PANEL + j] = src[(q * PANEL + j) * K + k];
  });
  return p;
}

// MR rows x NW panels: c[r, :] = a[r, :] @ panels (+ bias) (+ add[r, :]); `cols` of the tile's
// 32 * NW columns exist (the rest are not stored). K-loop order fixed: a row's result does not
// depend on which tile or batch it is in. SW (SwiGLU, NW = 2): the first panel is gate columns,
// the second the same up columns; c[r, :32] = silu(gate + bias) * (up + add), where `add` is
// then the up columns' bias.
template <int MR, int NW, bool SW = false>
static inline void tile(const float* a, int64_t K, const float* b, float* c, int64_t ldc, int64_t cols,
                        const float* bias, const float* add) {
  constexpr int U = 2 * NW;
  __m512 x[MR][U];
  for (int r = 0; r < MR; ++r)
    for (int u = 0; u < U; ++u) x[r][u] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[U];
    for (int u = 0; u < U; ++u) w[u] = _mm512_loadu_ps(b + (u / 2) * K * PANEL + k * PANEL + (u % 2) * 16);
    for (int r = 0; r < MR; ++r) {
      const __m512 v = _mm512_set1_ps(a[r * K + k]);
      for (int u = 0; u < U; ++u) x[r][u] = _mm512_fmadd_ps(v, w[u], x[r][u]);
    }
  }
  if constexpr (SW) {
    static_assert(NW == 2, "SwiGLU tiles are a gate panel and an up panel");
    for (int u = 0; u < 2; ++u) {
      const int64_t n = std::min<int64_t>(16, cols - 16 * u);
      if (n <= 0) break;
      const __mmask16 m = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
      const __m512 bg = bias ? _mm512_maskz_loadu_ps(m, bias + 16 * u) : _mm512_setzero_ps();
      const __m512 bu = add ? _mm512_maskz_loadu_ps(m, add + 16 * u) : _mm512_setzero_ps();
      for (int r = 0; r < MR; ++r) {
        alignas(64) float g[16], v[16];
        _mm512_store_ps(g, _mm512_add_ps(x[r][u], bg));
        _mm512_store_ps(v, _mm512_add_ps(x[r][u + 2], bu));
        for (int j = 0; j < 16; ++j) g[j] = g[j] / (1.f + vexp(-g[j])) * v[j];  // as cpu_ops' silu_mul
        _mm512_mask_storeu_ps(c + r * ldc + 16 * u, m, _mm512_load_ps(g));
      }
    }
    return;
  }
  for (int u = 0; u < U; ++u) {
    const int64_t n = std::min<int64_t>(16, cols - 16 * u);
    if (n <= 0) break;
    const __mmask16 m = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + 16 * u) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      __m512 y = _mm512_add_ps(x[r][u], bv);
      if (add) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, add + r * ldc + 16 * u));
      _mm512_mask_storeu_ps(c + r * ldc + 16 * u, m, y);
    }
  }
}

// Rows [0, M) of one work item: 6-row tiles, then the 1-5 rows left. `add` is per row (a
// residual), or, for SwiGLU, the up bias (the same for every row).
template <int NW, bool SW = false>
static void rows(const float* a, int64_t K, int64_t M, const float* b, float* c, int64_t ldc, int64_t cols,
                 const float* bias, const float* add) {
  int64_t r = 0;
  auto add_at = [&](int64_t i) { return SW || !add ? add : add + i * ldc; };
  for (; r + ROWS <= M; r += ROWS) tile<ROWS, NW, SW>(a + r * K, K, b, c + r * ldc, ldc, cols, bias, add_at(r));
  const float* ai = a + r * K;
  float* ci = c + r * ldc;
  const float* di = add_at(r);
  switch (M - r) {
    case 5: tile<5, NW, SW>(ai, K, b, ci, ldc, cols, bias, di); break;
    case 4: tile<4, NW, SW>(ai, K, b, ci, ldc, cols, bias, di); break;
    case 3: tile<3, NW, SW>(ai, K, b, ci, ldc, cols, bias, di); break;
    case 2: tile<2, NW, SW>(ai, K, b, ci, ldc, cols, bias, di); break;
    case 1: tile<1, NW, SW>(ai, K, b, ci, ldc, cols, bias, di); break;
    default: break;
  }
}

torch::Tensor linear(torch::Tensor x, torch::Tensor panels, int64_t n, c10::optional<torch::Tensor> bias,
                     c10::optional<torch::Tensor> add) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "panel_gemm.linear: x must be 2-D fp32, got ",
              x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == PANEL && panels.is_contiguous() &&
              panels.size(1) == x.size(1) && (n + PANEL - 1) / PANEL == panels.size(0),
              "panel_gemm.linear: panels ", panels.sizes(), " do not fit x ", x.sizes(), " and ", n, " columns");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), NP = panels.size(0);
  const float* bp = nullptr;
  const float* dp = nullptr;
  torch::Tensor bc, dc;
  if (bias.has_value()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == n, "panel_gemm.linear: bias must be fp32 [", n, "]");
    bp = bc.data_ptr<float>();
  }
  if (add.has_value()) {
    dc = add->contiguous();
    TORCH_CHECK(dc.scalar_type() == at::kFloat && dc.dim() == 2 && dc.size(0) == M && dc.size(1) == n,
                "panel_gemm.linear: add must be fp32 [", M, ", ", n, "]");
    dp = dc.data_ptr<float>();
  }
  auto out = torch::empty({M, n}, xc.options());
  const float* a = xc.data_ptr<float>();
  const float* b = panels.data_ptr<float>();
  float* c = out.data_ptr<float>();
  const int64_t supers = (NP + 1) / 2, chunks = (M + CHUNK - 1) / CHUNK;
  // items panel-pair-major: a thread's consecutive items reuse one pair of panels
  at::parallel_for(0, supers * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t s = it / chunks, r0 = (it % chunks) * CHUNK, m = std::min(CHUNK, M - r0);
      const int64_t c0 = 2 * s * PANEL, cols = std::min<int64_t>(2 * PANEL, n - c0);
      const float* bs = b + 2 * s * K * PANEL;
      const float* bi = bp ? bp + c0 : nullptr;
      const float* di = dp ? dp + r0 * n + c0 : nullptr;
      if (2 * s + 1 < NP) rows<2>(a + r0 * K, K, m, bs, c + r0 * n + c0, n, cols, bi, di);
      else rows<1>(a + r0 * K, K, m, bs, c + r0 * n + c0, n, cols, bi, di);
    }
  });
  return out;
}

// silu(x @ Wg.T + bg) * (x @ Wu.T + bu): [M, I], `panels` = gate and up panels interleaved
// (2 * ceil(I / 32) of them), `bias` the fused [2I] (gate | up) or absent.
torch::Tensor swiglu(torch::Tensor x, torch::Tensor panels, int64_t n, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "panel_gemm.swiglu: x must be 2-D fp32, got ",
              x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == PANEL && panels.is_contiguous() &&
              panels.size(1) == x.size(1) && 2 * ((n + PANEL - 1) / PANEL) == panels.size(0),
              "panel_gemm.swiglu: panels ", panels.sizes(), " do not fit x ", x.sizes(), " and ", n, " columns");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), supers = panels.size(0) / 2;
  torch::Tensor bc;
  const float* bp = nullptr;
  if (bias.has_value()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == 2 * n, "panel_gemm.swiglu: bias must be fp32 [", 2 * n, "]");
    bp = bc.data_ptr<float>();
  }
  auto out = torch::empty({M, n}, xc.options());
  const float* a = xc.data_ptr<float>();
  const float* b = panels.data_ptr<float>();
  float* c = out.data_ptr<float>();
  const int64_t chunks = (M + CHUNK - 1) / CHUNK;
  at::parallel_for(0, supers * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t s = it / chunks, r0 = (it % chunks) * CHUNK, m = std::min(CHUNK, M - r0);
      const int64_t c0 = s * PANEL, cols = std::min<int64_t>(PANEL, n - c0);
      rows<2, true>(a + r0 * K, K, m, b + 2 * s * K * PANEL, c + r0 * n + c0, n, cols,
                    bp ? bp + c0 : nullptr, bp ? bp + n + c0 : nullptr);
    }
  });
  return out;
}
"""


@dataclass(frozen=True)
class Panels:
    """A weight ``[n, K]`` packed for ``linear`` (``data``: ``[ceil(n / 32), K, 32]``), or
    (``gated``) gate and up weights ``[n, K]`` each packed for ``swiglu``."""
    data: torch.Tensor
    n: int
    gated: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        """The packed weight's ``[N, K]`` (gate and up together: ``[2n, K]``)."""
        return (2 if self.gated else 1) * self.n, self.data.shape[1]


def _load():
    return build("streamrl_panel_gemm_v2", _SOURCE, ("pack", "linear", "swiglu"), "panel GEMM (engine.cpu_prepack)")


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


def pack(weight: torch.Tensor, batch_hint: int | None = None) -> Panels:
    """``weight`` [N, K] packed into panels (``batch_hint``: unused, the panel layout is the
    same for every row count; taken for the signature ``prepacked.pack`` has)."""
    w = weight.detach()
    return Panels(_load().pack(w), w.shape[0])


def linear(x: torch.Tensor, packed: Panels, bias: torch.Tensor | None,
           add: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias) (+ add)`` for ``packed = pack(W)``; ``add`` [M, N] (a residual)."""
    return _load().linear(x, packed.data, packed.n, bias, add)


def pack_swiglu(gate: torch.Tensor, up: torch.Tensor) -> Panels:
    """Gate and up weights ``[I, K]`` packed for ``swiglu``: their panels interleaved (gate
    panel p, then up panel p), so one tile computes both halves of its 32 columns."""
    g, u = _load().pack(gate.detach()), _load().pack(up.detach())
    return Panels(torch.stack((g, u), dim=1).flatten(0, 1), gate.shape[0], gated=True)


def swiglu(x: torch.Tensor, packed: Panels, bias: torch.Tensor | None) -> torch.Tensor:
    """``silu(x @ Wg.T + bg) * (x @ Wu.T + bu)`` [M, I] for ``packed = pack_swiglu(Wg, Wu)``;
    ``bias``: the gate and up biases concatenated ([2I]) or None. The SwiGLU is the GEMM's
    epilogue: the [M, 2I] projection is never written."""
    return _load().swiglu(x, packed.data, packed.n, bias)
