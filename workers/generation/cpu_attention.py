"""Paged attention for the CPU: a small C++ kernel, compiled on first use (torch cpp_extension).

Attention backend "cpu" of the native engine. Each query token ``i`` (sequence ``seq_of[i]``,
absolute position ``positions[i]``) attends to keys ``[0, positions[i]]`` of its sequence,
read straight from the paged cache through the block table: no gather copy, no padding, no
mask, decode and prefill (with cached prefixes) alike. Work is split
over query tokens with ``at::parallel_for`` (torch's intra-op threads); a block's rows are
read front to back and the next block is prefetched; softmax and accumulation in fp32;
fp32, bf16 and fp16 caches. Why: with torch ops, decode attention over a paged cache has to
gather each sequence's blocks into a padded copy first, which on a CPU costs more than the
attention itself (see docs/engine.md). The build (~1 min, once per machine: cached under
``~/.cache/torch_extensions``) needs a C++ compiler.
"""
from __future__ import annotations

import torch

from workers.generation.cpp_build import build

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define STREAMRL_AVX2 1
#endif

template <typename T>
static inline void prefetch_rows(const T* p, int64_t rows, int64_t stride, int64_t len) {
  for (int64_t r = 0; r < rows; ++r) {
    const char* c = reinterpret_cast<const char*>(p + r * stride);
    for (int64_t o = 0; o < len * static_cast<int64_t>(sizeof(T)); o += 64) __builtin_prefetch(c + o, 0, 1);
  }
}

// A key/value row of one KV head as floats: fp32 caches are read in place, others converted.
template <typename T, int DH>
static inline const float* as_float(const T* p, float* buf, int64_t dh) {
  if constexpr (std::is_same_v<T, float>) {
    return p;
  } else {
    const int64_t n = DH ? DH : dh;
    for (int64_t d = 0; d < n; ++d) buf[d] = static_cast<float>(p[d]);
    return buf;
  }
}

#ifdef STREAMRL_AVX2
// 8 cache values -> 8 floats in a register (fp32 as is; bf16 = the high half of an fp32; fp16 via F16C).
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// Sums of 4 registers -> 4 floats.
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Scores of rows [0, nr) of one block for the G heads: sc[j * n + r] = q_j . k_r. Four rows at
// a time with independent accumulators (one dot product alone is an FMA latency chain).
template <typename C, int DH>
static inline void block_scores(const float* qf, const C* base, int64_t row, int64_t nr, int64_t G,
                                int64_t n, float* sc) {
  int64_t r = 0;
  for (; r + 4 <= nr; r += 4) {
    const C* k0 = base + r * row;
    for (int64_t j = 0; j < G; ++j) {
      const float* qh = qf + j * DH;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int d = 0; d < DH; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qh + d);
        a0 = _mm256_fmadd_ps(qv, load8(k0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, load8(k0 + row + d), a1);
        a2 = _mm256_fmadd_ps(qv, load8(k0 + 2 * row + d), a2);
        a3 = _mm256_fmadd_ps(qv, load8(k0 + 3 * row + d), a3);
      }
      _mm_storeu_ps(sc + j * n + r, hsum4(a0, a1, a2, a3));
    }
  }
  for (; r < nr; ++r) {
    const C* k0 = base + r * row;
    for (int64_t j = 0; j < G; ++j) {
      const float* qh = qf + j * DH;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0;
      for (int d = 0; d < DH; d += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), load8(k0 + d), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d + 8), load8(k0 + d + 8), a1);
      }
      float t[4];
      _mm_storeu_ps(t, hsum4(a0, a1, _mm256_setzero_ps(), _mm256_setzero_ps()));
      sc[j * n + r] = t[0] + t[1];
    }
  }
}

// acc_j += sum_r p_j[r] * v_r for the G heads, over rows [0, nr) of one block; 64 columns at
// a time in 8 registers.
template <typename C, int DH>
static inline void block_values(const float* sc, const C* base, int64_t row, int64_t nr, int64_t G,
                                int64_t n, float* acc) {
  for (int64_t j = 0; j < G; ++j) {
    const float* p = sc + j * n;
    for (int d0 = 0; d0 < DH; d0 += 64) {
      float* ah = acc + j * DH + d0;
      __m256 a[8];
      for (int u = 0; u < 8; ++u) a[u] = _mm256_loadu_ps(ah + 8 * u);
      for (int64_t r = 0; r < nr; ++r) {
        const __m256 pr = _mm256_set1_ps(p[r]);
        const C* vp = base + r * row + d0;
        for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(pr, load8(vp + 8 * u), a[u]);
      }
      for (int u = 0; u < 8; ++u) _mm256_storeu_ps(ah + 8 * u, a[u]);
    }
  }
}
template <typename C>
constexpr bool kVec = std::is_same_v<C, float> || std::is_same_v<C, c10::BFloat16> || std::is_same_v<C, c10::Half>;
#endif

// One work item = (query token i, KV head g): the G = H / Hkv query heads of that group
// share each key/value row (read once per block, from L1 for the G heads). DH > 0 fixes the
// head size at compile time (64, 128: AVX2 blocks above where the CPU has them); DH == 0 is
// generic. Three passes: scores [G, n], softmax, weighted values; block b+1 is prefetched
// while b is used. T: q/out dtype; C: cache dtype (T, or bf16/fp16 under an fp32 q).
template <typename T, typename C, int DH>
static void attend(const T* q, int64_t q_stride, const C* kc, const C* vc, const int* bt,
                   const int64_t* seq_of, const int64_t* pos, T* out, int64_t ntok, int64_t H,
                   int64_t Hkv, int64_t dh_rt,
                   int64_t bs, int64_t maxb, float scale) {
  const int64_t Dh = DH ? DH : dh_rt;
  const int64_t G = H / Hkv, row = Hkv * Dh, block_elems = bs * row;
  at::parallel_for(0, ntok * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * Dh), acc(G * Dh), buf(Dh), sc;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / Hkv, g = item % Hkv;
      const int* table = bt + seq_of[i] * maxb;
      const int64_t n = pos[i] + 1, nblk = (n + bs - 1) / bs;
      const T* qi = q + i * q_stride + g * G * Dh;
      for (int64_t j = 0; j < G * Dh; ++j) qf[j] = static_cast<float>(qi[j]) * scale;
      sc.resize(G * n);
      for (int64_t b = 0; b < nblk; ++b) {  // pass 1: scores [G, n]
        const C* base = kc + static_cast<int64_t>(table[b]) * block_elems + g * Dh;
        const int64_t t0 = b * bs, t_end = std::min(bs, n - t0);
        if (b + 1 < nblk) prefetch_rows(kc + static_cast<int64_t>(table[b + 1]) * block_elems + g * Dh, bs, row, Dh);
#ifdef STREAMRL_AVX2
        if constexpr (DH > 0 && kVec<C>) {
          block_scores<C, DH>(qf.data(), base, row, t_end, G, n, sc.data() + t0);
          continue;
        }
#endif
        for (int64_t r = 0; r < t_end; ++r) {
          const float* kp = as_float<C, DH>(base + r * row, buf.data(), Dh);
          for (int64_t j = 0; j < G; ++j) {
            const float* qh = qf.data() + j * Dh;
            float dot = 0.f;
            for (int64_t d = 0; d < Dh; ++d) dot += qh[d] * kp[d];
            sc[j * n + t0 + r] = dot;
          }
        }
      }
      for (int64_t j = 0; j < G; ++j) {  // softmax per head
        float* s = sc.data() + j * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < nblk; ++b) {  // pass 2: weighted values
        const C* base = vc + static_cast<int64_t>(table[b]) * block_elems + g * Dh;
        const int64_t t0 = b * bs, t_end = std::min(bs, n - t0);
        if (b + 1 < nblk) prefetch_rows(vc + static_cast<int64_t>(table[b + 1]) * block_elems + g * Dh, bs, row, Dh);
#ifdef STREAMRL_AVX2
        if constexpr (DH > 0 && kVec<C>) {
          block_values<C, DH>(sc.data() + t0, base, row, t_end, G, n, acc.data());
          continue;
        }
#endif
        for (int64_t j = 0; j < G; ++j) {
          const float* p = sc.data() + j * n + t0;
          float a[DH ? DH : 1];
          float* ah = DH ? a : acc.data() + j * Dh;
          if (DH) std::copy(acc.data() + j * Dh, acc.data() + (j + 1) * Dh, a);
          for (int64_t r = 0; r < t_end; ++r) {
            const float* vp = as_float<C, DH>(base + r * row, buf.data(), Dh);
            for (int64_t d = 0; d < Dh; ++d) ah[d] += p[r] * vp[d];
          }
          if (DH) std::copy(a, a + Dh, acc.data() + j * Dh);
        }
      }
      T* o = out + (i * H + g * G) * Dh;
      for (int64_t j = 0; j < G * Dh; ++j) o[j] = static_cast<T>(acc[j]);
    }
  });
}

template <typename T, typename C>
static void run_attend(torch::Tensor& q, torch::Tensor& k_cache, torch::Tensor& v_cache,
                       torch::Tensor& block_tables, torch::Tensor& seq_of, torch::Tensor& positions,
                       torch::Tensor& out, double scale) {
  const int64_t ntok = q.size(0), H = q.size(1), Dh = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), maxb = block_tables.size(1);
  auto run = [&](auto dh_const) {
    constexpr int DH = decltype(dh_const)::value;
    attend<T, C, DH>(q.data_ptr<T>(), q.stride(0), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(),
                     block_tables.data_ptr<int>(), seq_of.data_ptr<int64_t>(), positions.data_ptr<int64_t>(),
                     out.data_ptr<T>(), ntok, H, Hkv, Dh, bs, maxb, static_cast<float>(scale));
  };
  if (Dh == 64) run(std::integral_constant<int, 64>());
  else if (Dh == 128) run(std::integral_constant<int, 128>());
  else run(std::integral_constant<int, 0>());
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_of,
                              torch::Tensor positions, double scale) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "paged_attention: caches and q's rows must be contiguous");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && block_tables.is_contiguous(),
              "paged_attention: block_tables must be contiguous int32");
  TORCH_CHECK(seq_of.dtype() == torch::kInt64 && positions.dtype() == torch::kInt64,
              "paged_attention: seq_of and positions must be int64");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_attention: k and v caches differ in dtype");
  const bool mixed = q.scalar_type() == at::kFloat &&
                     (k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kHalf);
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() || mixed,
              "paged_attention: the caches must have q's dtype, or be bf16/fp16 under an fp32 q");
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && k_cache.size(3) == q.size(2),
              "paged_attention: head shapes do not match");
  if (mixed && k_cache.scalar_type() == at::kBFloat16) {
    run_attend<float, c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_of, positions, out, scale);
  } else if (mixed) {
    run_attend<float, c10::Half>(q, k_cache, v_cache, block_tables, seq_of, positions, out, scale);
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
      run_attend<scalar_t, scalar_t>(q, k_cache, v_cache, block_tables, seq_of, positions, out, scale);
    });
  }
  return out;
}
"""


def load():
    """The compiled extension (built on first call, then cached on disk and in memory)."""
    return build("streamrl_paged_attention_cpu_v6", _SOURCE, ("paged_attention",), "engine.attention_backend 'cpu'")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_of: torch.Tensor, positions: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q: [T, H, Dh]; caches: [num_blocks, block_size, Hkv, Dh]; block_tables: int32 [B, M];
    seq_of, positions: int64 [T] -> out [T, H, Dh]. Token i attends to keys 0..positions[i]
    of sequence seq_of[i] (its own k/v must already be in the cache). q may be a row-strided
    view (e.g. of a fused qkv projection): only each token's [H, Dh] must be contiguous."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    return load().paged_attention(q, k_cache, v_cache, block_tables, seq_of, positions, scale)
