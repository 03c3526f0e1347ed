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

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static inline void prefetch_block(const T* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 1);
}

// One work item = one query token, all heads: the rows of a block ([bs, Hkv, Dh]) are read
// front to back (contiguous), and the next block is prefetched while this one is used.
template <typename T>
static void attend(const T* q, const T* kc, const T* vc, const int* bt, const int64_t* seq_of,
                   const int64_t* pos, T* out, int64_t ntok, int64_t H, int64_t Hkv, int64_t Dh,
                   int64_t bs, int64_t maxb, float scale) {
  const int64_t G = H / Hkv, row = Hkv * Dh, block_elems = bs * row;
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(T));
  at::parallel_for(0, ntok, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * Dh), acc(H * Dh), xf(row), sc;
    for (int64_t i = begin; i < end; ++i) {
      const int* table = bt + seq_of[i] * maxb;
      const int64_t n = pos[i] + 1, nblk = (n + bs - 1) / bs;
      for (int64_t j = 0; j < H * Dh; ++j) qf[j] = static_cast<float>(q[i * H * Dh + j]) * scale;
      sc.assign(H * n, 0.f);
      for (int64_t b = 0; b < nblk; ++b) {  // pass 1: scores [H, n]
        const T* base = kc + static_cast<int64_t>(table[b]) * block_elems;
        if (b + 1 < nblk) prefetch_block(kc + static_cast<int64_t>(table[b + 1]) * block_elems, block_bytes);
        const int64_t t_end = std::min(bs, n - b * bs);
        for (int64_t r = 0; r < t_end; ++r) {
          const T* kp = base + r * row;
          for (int64_t d = 0; d < row; ++d) xf[d] = static_cast<float>(kp[d]);
          for (int64_t h = 0; h < H; ++h) {
            const float* qh = qf.data() + h * Dh;
            const float* kh = xf.data() + (h / G) * Dh;
            float dot = 0.f;
            for (int64_t d = 0; d < Dh; ++d) dot += qh[d] * kh[d];
            sc[h * n + b * bs + r] = dot;
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) {  // softmax per head
        float* s = sc.data() + h * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) m = s[t] > m ? s[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < nblk; ++b) {  // pass 2: weighted values
        const T* base = vc + static_cast<int64_t>(table[b]) * block_elems;
        if (b + 1 < nblk) prefetch_block(vc + static_cast<int64_t>(table[b + 1]) * block_elems, block_bytes);
        const int64_t t_end = std::min(bs, n - b * bs);
        for (int64_t r = 0; r < t_end; ++r) {
          const T* vp = base + r * row;
          for (int64_t d = 0; d < row; ++d) xf[d] = static_cast<float>(vp[d]);
          for (int64_t h = 0; h < H; ++h) {
            const float p = sc[h * n + b * bs + r];
            const float* vh = xf.data() + (h / G) * Dh;
            float* a = acc.data() + h * Dh;
            for (int64_t d = 0; d < Dh; ++d) a[d] += p * vh[d];
          }
        }
      }
      for (int64_t j = 0; j < H * Dh; ++j) out[i * H * Dh + j] = static_cast<T>(acc[j]);
    }
  });
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_of,
                              torch::Tensor positions, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: q and caches must be contiguous");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && block_tables.is_contiguous(),
              "paged_attention: block_tables must be contiguous int32");
  TORCH_CHECK(seq_of.dtype() == torch::kInt64 && positions.dtype() == torch::kInt64,
              "paged_attention: seq_of and positions must be int64");
  auto out = torch::empty_like(q);
  const int64_t ntok = q.size(0), H = q.size(1), Dh = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), maxb = block_tables.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attend<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                     block_tables.data_ptr<int>(), seq_of.data_ptr<int64_t>(),
                     positions.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), ntok, H, Hkv, Dh, bs,
                     maxb, static_cast<float>(scale));
  });
  return out;
}
"""

_module = None


def load():
    """The compiled extension (built on first call, then cached on disk and in memory)."""
    global _module
    if _module is None:
        from torch.utils.cpp_extension import load_inline

        try:
            _module = load_inline(name="streamrl_paged_attention_cpu", cpp_sources=_SOURCE,
                                  functions=["paged_attention"],
                                  extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                                  extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as e:  # no compiler, headers, ...
            raise RuntimeError(f"engine.attention_backend 'cpu': building the C++ kernel failed "
                               f"({e}); use attention_backend 'torch'") from e
    return _module


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_of: torch.Tensor, positions: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q: [T, H, Dh]; caches: [num_blocks, block_size, Hkv, Dh]; block_tables: int32 [B, M];
    seq_of, positions: int64 [T] -> out [T, H, Dh]. Token i attends to keys 0..positions[i]
    of sequence seq_of[i] (its own k/v must already be in the cache)."""
    return load().paged_attention(q.contiguous(), k_cache, v_cache, block_tables, seq_of, positions, scale)
