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

// One work item = (query token i, KV head g): the G = H / Hkv query heads of that group
// share each key/value row (read once per block, from L1 for the G heads). DH > 0 fixes the
// head size at compile time (unrolled, accumulators in registers); DH == 0 is generic.
// Three passes: scores [G, n], softmax, weighted values; block b+1 is prefetched while b is used.
template <typename T, int DH>
static void attend(const T* q, int64_t q_stride, const T* kc, const T* vc, const int* bt,
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
        const T* base = kc + static_cast<int64_t>(table[b]) * block_elems + g * Dh;
        const int64_t t0 = b * bs, t_end = std::min(bs, n - t0);
        if (b + 1 < nblk) prefetch_rows(kc + static_cast<int64_t>(table[b + 1]) * block_elems + g * Dh, bs, row, Dh);
        for (int64_t r = 0; r < t_end; ++r) {
          const float* kp = as_float<T, DH>(base + r * row, buf.data(), Dh);
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
        const T* base = vc + static_cast<int64_t>(table[b]) * block_elems + g * Dh;
        const int64_t t0 = b * bs, t_end = std::min(bs, n - t0);
        if (b + 1 < nblk) prefetch_rows(vc + static_cast<int64_t>(table[b + 1]) * block_elems + g * Dh, bs, row, Dh);
        for (int64_t j = 0; j < G; ++j) {
          const float* p = sc.data() + j * n + t0;
          float a[DH ? DH : 1];
          float* ah = DH ? a : acc.data() + j * Dh;
          if (DH) std::copy(acc.data() + j * Dh, acc.data() + (j + 1) * Dh, a);
          for (int64_t r = 0; r < t_end; ++r) {
            const float* vp = as_float<T, DH>(base + r * row, buf.data(), Dh);
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

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_of,
                              torch::Tensor positions, double scale) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "paged_attention: caches and q's rows must be contiguous");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && block_tables.is_contiguous(),
              "paged_attention: block_tables must be contiguous int32");
  TORCH_CHECK(seq_of.dtype() == torch::kInt64 && positions.dtype() == torch::kInt64,
              "paged_attention: seq_of and positions must be int64");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_attention: q and caches must have the same dtype");
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const int64_t ntok = q.size(0), H = q.size(1), Dh = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), maxb = block_tables.size(1);
  TORCH_CHECK(H % Hkv == 0 && k_cache.size(3) == Dh, "paged_attention: head shapes do not match");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    auto run = [&](auto dh_const) {
      constexpr int DH = decltype(dh_const)::value;
      attend<scalar_t, DH>(q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(),
                           v_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int>(),
                           seq_of.data_ptr<int64_t>(), positions.data_ptr<int64_t>(),
                           out.data_ptr<scalar_t>(), ntok, H, Hkv, Dh, bs, maxb, static_cast<float>(scale));
    };
    if (Dh == 64) run(std::integral_constant<int, 64>());
    else if (Dh == 128) run(std::integral_constant<int, 128>());
    else run(std::integral_constant<int, 0>());
  });
  return out;
}
"""


def load():
    """The compiled extension (built on first call, then cached on disk and in memory)."""
    return build("streamrl_paged_attention_cpu_v5", _SOURCE, ("paged_attention",), "engine.attention_backend 'cpu'")


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
