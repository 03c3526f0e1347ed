#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>

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

// What a tile does with its products, each pointer already at the tile's first row / column.
struct Epilogue {
  const float* scale = nullptr;  // per row: 1 / rms of the input row (a folded RMSNorm)
  const float* bias = nullptr;   // per column (SwiGLU: the gate columns')
  const float* up_bias = nullptr;  // SwiGLU: the up columns' bias
  const float* add = nullptr;    // a residual, rows ldc apart
};

// MR rows x NW panels: c[r, :] = scale[r] * (a[r, :] @ panels) + bias + add[r, :]; `cols` of the
// tile's 32 * NW columns exist (the rest are not stored). One k order: a row's result does not
// depend on which tile or batch it is in. SW (SwiGLU, NW = 2): the first panel is gate columns,
// the second the same up columns, and c[r, :32] = silu(gate) * up.
template <int MR, int NW, bool SW>
static inline void tile(const float* a, int64_t K, const float* b, float* c, int64_t ldc, int64_t cols,
                        const Epilogue& e) {
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
  if (e.scale)
    for (int r = 0; r < MR; ++r)
      for (int u = 0; u < U; ++u) x[r][u] = _mm512_mul_ps(x[r][u], _mm512_set1_ps(e.scale[r]));
  for (int u = 0; u < (SW ? 2 : U); ++u) {
    const int64_t n = std::min<int64_t>(16, cols - 16 * u);
    if (n <= 0) break;
    const __mmask16 m = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
    const __m512 bv = e.bias ? _mm512_maskz_loadu_ps(m, e.bias + 16 * u) : _mm512_setzero_ps();
    if constexpr (SW) {
      const __m512 bu = e.up_bias ? _mm512_maskz_loadu_ps(m, e.up_bias + 16 * u) : _mm512_setzero_ps();
      for (int r = 0; r < MR; ++r) {
        alignas(64) float g[16], v[16];
        _mm512_store_ps(g, _mm512_add_ps(x[r][u], bv));
        _mm512_store_ps(v, _mm512_add_ps(x[r][u + 2], bu));
        for (int j = 0; j < 16; ++j) g[j] = g[j] / (1.f + vexp(-g[j])) * v[j];  // as cpu_ops' silu_mul
        _mm512_mask_storeu_ps(c + r * ldc + 16 * u, m, _mm512_load_ps(g));
      }
    } else {
      for (int r = 0; r < MR; ++r) {
        __m512 y = _mm512_add_ps(x[r][u], bv);
        if (e.add) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, e.add + r * ldc + 16 * u));
        _mm512_mask_storeu_ps(c + r * ldc + 16 * u, m, y);
      }
    }
  }
}

// Rows [0, M) of one work item: 6-row tiles, then the 1-5 rows left.
template <int NW, bool SW>
static void rows(const float* a, int64_t K, int64_t M, const float* b, float* c, int64_t ldc, int64_t cols,
                 const Epilogue& e) {
  auto at = [&](int64_t r) {
    Epilogue f = e;
    if (f.scale) f.scale += r;
    if (f.add) f.add += r * ldc;
    return f;
  };
  int64_t r = 0;
  for (; r + ROWS <= M; r += ROWS) tile<ROWS, NW, SW>(a + r * K, K, b, c + r * ldc, ldc, cols, at(r));
  const float* ai = a + r * K;
  float* ci = c + r * ldc;
  const Epilogue f = at(r);
  switch (M - r) {
    case 5: tile<5, NW, SW>(ai, K, b, ci, ldc, cols, f); break;
    case 4: tile<4, NW, SW>(ai, K, b, ci, ldc, cols, f); break;
    case 3: tile<3, NW, SW>(ai, K, b, ci, ldc, cols, f); break;
    case 2: tile<2, NW, SW>(ai, K, b, ci, ldc, cols, f); break;
    case 1: tile<1, NW, SW>(ai, K, b, ci, ldc, cols, f); break;
    default: break;
  }
}

// out [M, n]: linear (sw false; panels ceil(n / 32)) or SwiGLU (sw; gate and up panels
// interleaved, 2 * ceil(n / 32), bias [2n] = gate | up). rms_eps >= 0: each input row is first
// RMS-normalised with it (the norm's weight was folded into the panels at packing).
static torch::Tensor run(const char* what, torch::Tensor x, torch::Tensor panels, int64_t n,
                         c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> add, double rms_eps, bool sw) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, what, ": x must be 2-D fp32, got ", x.sizes(), " ",
              x.scalar_type());
  const int64_t per = (n + PANEL - 1) / PANEL;
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == PANEL && panels.is_contiguous() &&
              panels.size(1) == x.size(1) && (sw ? 2 : 1) * per == panels.size(0),
              what, ": panels ", panels.sizes(), " do not fit x ", x.sizes(), " and ", n, " columns");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), NP = panels.size(0);
  torch::Tensor bc, dc;
  const float* bp = nullptr;
  const float* dp = nullptr;
  if (bias.has_value()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == (sw ? 2 : 1) * n, what, ": bias must be fp32 [",
                (sw ? 2 : 1) * n, "]");
    bp = bc.data_ptr<float>();
  }
  if (add.has_value()) {
    dc = add->contiguous();
    TORCH_CHECK(dc.scalar_type() == at::kFloat && dc.dim() == 2 && dc.size(0) == M && dc.size(1) == n,
                what, ": add must be fp32 [", M, ", ", n, "]");
    dp = dc.data_ptr<float>();
  }
  auto out = torch::empty({M, n}, xc.options());
  const float* a = xc.data_ptr<float>();
  const float* b = panels.data_ptr<float>();
  float* c = out.data_ptr<float>();
  // items of (64 output columns, up to CHUNK rows), column-major: a thread's consecutive items
  // reuse one pair of panels (SwiGLU: 32 output columns, a gate and an up panel)
  const int64_t supers = sw ? NP / 2 : (NP + 1) / 2, width = sw ? PANEL : 2 * PANEL;
  const int64_t chunks = (M + CHUNK - 1) / CHUNK;
  at::parallel_for(0, supers * chunks, 1, [&](int64_t begin, int64_t end) {
    float inv[CHUNK];
    for (int64_t it = begin; it < end; ++it) {
      const int64_t s = it / chunks, r0 = (it % chunks) * CHUNK, m = std::min(CHUNK, M - r0);
      const int64_t c0 = s * width, cols = std::min<int64_t>(width, n - c0);
      const float* ai = a + r0 * K;
      Epilogue e;
      if (rms_eps >= 0) {
        for (int64_t i = 0; i < m; ++i) {
          float ss = 0.f;
          for (int64_t k = 0; k < K; ++k) ss += ai[i * K + k] * ai[i * K + k];
          inv[i] = 1.f / std::sqrt(ss / static_cast<float>(K) + static_cast<float>(rms_eps));
        }
        e.scale = inv;
      }
      e.bias = bp ? bp + c0 : nullptr;
      e.up_bias = sw && bp ? bp + n + c0 : nullptr;
      e.add = dp ? dp + r0 * n + c0 : nullptr;
      const float* bs = b + 2 * s * K * PANEL;
      float* cs = c + r0 * n + c0;
      if (sw) rows<2, true>(ai, K, m, bs, cs, n, cols, e);
      else if (2 * s + 1 < NP) rows<2, false>(ai, K, m, bs, cs, n, cols, e);
      else rows<1, false>(ai, K, m, bs, cs, n, cols, e);
    }
  });
  return out;
}

torch::Tensor linear(torch::Tensor x, torch::Tensor panels, int64_t n, c10::optional<torch::Tensor> bias,
                     c10::optional<torch::Tensor> add, double rms_eps) {
  return run("panel_gemm.linear", x, panels, n, bias, add, rms_eps, false);
}

torch::Tensor swiglu(torch::Tensor x, torch::Tensor panels, int64_t n, c10::optional<torch::Tensor> bias,
                     double rms_eps) {
  return run("panel_gemm.swiglu", x, panels, n, bias, c10::nullopt, rms_eps, true);
}
