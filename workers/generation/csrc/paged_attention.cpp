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

// Layout: a block's rows with row stride `rs` (the cache's row: KV heads x Dh, the item's
// first KV head at the start), scores sc[h * bs + r] for the item's query heads h (kv head h / G).

// Software prefetch (into L2: locality 2, PREFETCHT1 on x86) of the next block a decode token
// reads, spread over the arithmetic on the current one: `step(k)` issues the next k of its
// 64-byte lines (K's rows, then V's), `rest()` the ones left. So memory works while the core
// computes, instead of the two taking turns (touch, then arithmetic).
struct NextBlock {
  const char* p[2] = {nullptr, nullptr};
  int64_t n[2] = {0, 0};
  int idx = 2;
  int64_t off = 0;
  inline void set(const void* k, const void* v, int64_t bytes) {
    p[0] = static_cast<const char*>(k); p[1] = static_cast<const char*>(v); n[0] = n[1] = bytes; idx = 0; off = 0;
  }
  inline void step(int k) {
    for (; k > 0 && idx < 2; --k) {
      __builtin_prefetch(p[idx] + off, 0, 2);
      off += 64;
      if (off >= n[idx]) { ++idx; off = 0; }
    }
  }
  inline void rest() { step(1 << 30); }
};
// Lines issued per 4 score rows of a KV head, and per 4 value rows of a query head: at
// workload (a)'s shapes (2 KV heads, 4 query heads, Dh 64, fp32, blocks of 128 rows: 2,048
// lines a block) the next block is requested by about two thirds of the way through the
// current one's arithmetic. Measured on 64 decode tokens at ~200 cached tokens, 4 layers from
// DRAM, 15 alternating trials: 2.23 -> 1.81 ms (15 of 15 faster); 8 and 2 lines: slower than
// no prefetch (the rest went in one burst at the end); hints T0/T2: 11-14% faster, T1: 17-23%.
constexpr int kPrefetchPerScoreQuad = 24, kPrefetchPerValueQuad = 12;

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
static inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
template <typename C>
constexpr bool kVec = std::is_same_v<C, float> || std::is_same_v<C, c10::BFloat16> || std::is_same_v<C, c10::Half>;

// Scores of rows [0, nr) against the G query heads of each of the nkv KV heads: 4 rows x 2
// heads = 8 independent accumulators (one dot product alone is an FMA latency chain).
template <typename C, int DH>
static inline void scores_avx(const float* qf, const C* kb, int64_t rs, int64_t nr, int64_t nkv,
                              int64_t G, int64_t bs, float* sc, NextBlock& next) {
  for (int64_t g = 0; g < nkv; ++g) {
    int64_t r = 0;
    for (; r + 4 <= nr; r += 4) {
      next.step(kPrefetchPerScoreQuad);
      const C* k0 = kb + r * rs + g * DH;
      int64_t j = 0;
      for (; j + 2 <= G; j += 2) {
        const float* qa = qf + (g * G + j) * DH;
        const float* qb = qa + DH;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int d = 0; d < DH; d += 8) {
          const __m256 x0 = load8(k0 + d), x1 = load8(k0 + rs + d), x2 = load8(k0 + 2 * rs + d),
                       x3 = load8(k0 + 3 * rs + d);
          const __m256 va = _mm256_loadu_ps(qa + d), vb = _mm256_loadu_ps(qb + d);
          a0 = _mm256_fmadd_ps(va, x0, a0); a1 = _mm256_fmadd_ps(va, x1, a1);
          a2 = _mm256_fmadd_ps(va, x2, a2); a3 = _mm256_fmadd_ps(va, x3, a3);
          b0 = _mm256_fmadd_ps(vb, x0, b0); b1 = _mm256_fmadd_ps(vb, x1, b1);
          b2 = _mm256_fmadd_ps(vb, x2, b2); b3 = _mm256_fmadd_ps(vb, x3, b3);
        }
        _mm_storeu_ps(sc + (g * G + j) * bs + r, hsum4(a0, a1, a2, a3));
        _mm_storeu_ps(sc + (g * G + j + 1) * bs + r, hsum4(b0, b1, b2, b3));
      }
      for (; j < G; ++j) {
        const float* qa = qf + (g * G + j) * DH;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int d = 0; d < DH; d += 8) {
          const __m256 va = _mm256_loadu_ps(qa + d);
          a0 = _mm256_fmadd_ps(va, load8(k0 + d), a0); a1 = _mm256_fmadd_ps(va, load8(k0 + rs + d), a1);
          a2 = _mm256_fmadd_ps(va, load8(k0 + 2 * rs + d), a2); a3 = _mm256_fmadd_ps(va, load8(k0 + 3 * rs + d), a3);
        }
        _mm_storeu_ps(sc + (g * G + j) * bs + r, hsum4(a0, a1, a2, a3));
      }
    }
    for (; r < nr; ++r) {
      const C* kr = kb + r * rs + g * DH;
      for (int64_t j = 0; j < G; ++j) {
        const float* qh = qf + (g * G + j) * DH;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (int d = 0; d < DH; d += 16) {
          a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), load8(kr + d), a0);
          a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d + 8), load8(kr + d + 8), a1);
        }
        sc[(g * G + j) * bs + r] = hsum(_mm256_add_ps(a0, a1));
      }
    }
  }
}

// acc_h += sum_r p_h[r] * v_r over rows [0, nr), 64 columns at a time in 8 registers.
template <typename C, int DH>
static inline void values_avx(const float* sc, const C* vb, int64_t rs, int64_t nr, int64_t nkv,
                              int64_t G, int64_t bs, float* acc, NextBlock& next) {
  for (int64_t h = 0; h < nkv * G; ++h) {
    const float* p = sc + h * bs;
    const C* v0 = vb + (h / G) * DH;
    for (int d0 = 0; d0 < DH; d0 += 64) {
      float* ah = acc + h * DH + d0;
      __m256 a[8];
      for (int u = 0; u < 8; ++u) a[u] = _mm256_loadu_ps(ah + 8 * u);
      for (int64_t r = 0; r < nr; ++r) {
        if ((r & 3) == 0) next.step(kPrefetchPerValueQuad);
        const __m256 pr = _mm256_set1_ps(p[r]);
        const C* vp = v0 + r * rs + d0;
        for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(pr, load8(vp + 8 * u), a[u]);
      }
      for (int u = 0; u < 8; ++u) _mm256_storeu_ps(ah + 8 * u, a[u]);
    }
  }
}
#endif

#if defined(STREAMRL_AVX2) && defined(__AVX512F__)
#define STREAMRL_AVX512 1
// An fp32 cache on an AVX-512 CPU: 16 floats a register, a pair of query heads at a time held
// in registers for the whole block (the AVX2 loops reload q for every 4 rows, and read V once
// per query head; here once per pair).
static inline __m256 fold512(__m512 x) {
  return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

// Scores of rows [0, nr): for each KV head, its query heads two at a time (a lone last head
// is computed twice and stored once), 4 rows x 2 heads = 8 accumulators per step.
template <int DH>
static inline void scores_512(const float* qf, const float* kb, int64_t rs, int64_t nr, int64_t nkv,
                              int64_t G, int64_t bs, float* sc, NextBlock& next) {
  constexpr int V = DH / 16;
  for (int64_t g = 0; g < nkv; ++g) {
    for (int64_t j = 0; j < G; j += 2) {
      const bool two = j + 1 < G;
      const float* qa = qf + (g * G + j) * DH;
      const float* qb = two ? qa + DH : qa;
      __m512 va[V], vb[V];
      for (int u = 0; u < V; ++u) va[u] = _mm512_loadu_ps(qa + 16 * u), vb[u] = _mm512_loadu_ps(qb + 16 * u);
      float* sa = sc + (g * G + j) * bs;
      float* sb = sa + bs;
      const float* kg = kb + g * DH;
      int64_t r = 0;
      for (; r + 4 <= nr; r += 4) {
        if (j == 0) next.step(kPrefetchPerScoreQuad);
        const float* k0 = kg + r * rs;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int u = 0; u < V; ++u) {
          const __m512 x0 = _mm512_loadu_ps(k0 + 16 * u), x1 = _mm512_loadu_ps(k0 + rs + 16 * u),
                       x2 = _mm512_loadu_ps(k0 + 2 * rs + 16 * u), x3 = _mm512_loadu_ps(k0 + 3 * rs + 16 * u);
          a0 = _mm512_fmadd_ps(va[u], x0, a0); a1 = _mm512_fmadd_ps(va[u], x1, a1);
          a2 = _mm512_fmadd_ps(va[u], x2, a2); a3 = _mm512_fmadd_ps(va[u], x3, a3);
          b0 = _mm512_fmadd_ps(vb[u], x0, b0); b1 = _mm512_fmadd_ps(vb[u], x1, b1);
          b2 = _mm512_fmadd_ps(vb[u], x2, b2); b3 = _mm512_fmadd_ps(vb[u], x3, b3);
        }
        _mm_storeu_ps(sa + r, hsum4(fold512(a0), fold512(a1), fold512(a2), fold512(a3)));
        if (two) _mm_storeu_ps(sb + r, hsum4(fold512(b0), fold512(b1), fold512(b2), fold512(b3)));
      }
      for (; r < nr; ++r) {
        const float* kr = kg + r * rs;
        __m512 a = _mm512_setzero_ps(), b = a;
        for (int u = 0; u < V; ++u) {
          const __m512 x = _mm512_loadu_ps(kr + 16 * u);
          a = _mm512_fmadd_ps(va[u], x, a); b = _mm512_fmadd_ps(vb[u], x, b);
        }
        sa[r] = hsum(fold512(a));
        if (two) sb[r] = hsum(fold512(b));
      }
    }
  }
}

// acc_h += sum_r p_h[r] * v_r over rows [0, nr), query heads two at a time: each V row is
// loaded once for both.
template <int DH>
static inline void values_512(const float* sc, const float* vb, int64_t rs, int64_t nr, int64_t nkv,
                              int64_t G, int64_t bs, float* acc, NextBlock& next) {
  constexpr int V = DH / 16;
  for (int64_t g = 0; g < nkv; ++g) {
    for (int64_t j = 0; j < G; j += 2) {
      const bool two = j + 1 < G;
      const float* pa = sc + (g * G + j) * bs;
      const float* pb = two ? pa + bs : pa;
      float* aa = acc + (g * G + j) * DH;
      float* ab = aa + DH;
      __m512 xa[V], xb[V];
      for (int u = 0; u < V; ++u) {
        xa[u] = _mm512_loadu_ps(aa + 16 * u);
        xb[u] = two ? _mm512_loadu_ps(ab + 16 * u) : _mm512_setzero_ps();
      }
      const float* v0 = vb + g * DH;
      for (int64_t r = 0; r < nr; ++r) {
        if (j == 0 && (r & 3) == 0) next.step(kPrefetchPerValueQuad * G);
        const __m512 ra = _mm512_set1_ps(pa[r]), rb = _mm512_set1_ps(pb[r]);
        const float* vp = v0 + r * rs;
        for (int u = 0; u < V; ++u) {
          const __m512 v = _mm512_loadu_ps(vp + 16 * u);
          xa[u] = _mm512_fmadd_ps(ra, v, xa[u]);
          xb[u] = _mm512_fmadd_ps(rb, v, xb[u]);
        }
      }
      for (int u = 0; u < V; ++u) {
        _mm512_storeu_ps(aa + 16 * u, xa[u]);
        if (two) _mm512_storeu_ps(ab + 16 * u, xb[u]);
      }
    }
  }
}
#endif

template <typename C>
static inline void scores_generic(const float* qf, const C* kb, int64_t rs, int64_t nr, int64_t nkv,
                                  int64_t G, int64_t Dh, int64_t bs, float* sc) {
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t h = 0; h < nkv * G; ++h) {
      const C* kp = kb + r * rs + (h / G) * Dh;
      const float* qh = qf + h * Dh;
      float dot = 0.f;
      for (int64_t d = 0; d < Dh; ++d) dot += qh[d] * static_cast<float>(kp[d]);
      sc[h * bs + r] = dot;
    }
}

template <typename C>
static inline void values_generic(const float* sc, const C* vb, int64_t rs, int64_t nr, int64_t nkv,
                                  int64_t G, int64_t Dh, int64_t bs, float* acc) {
  for (int64_t h = 0; h < nkv * G; ++h)
    for (int64_t r = 0; r < nr; ++r) {
      const float p = sc[h * bs + r];
      const C* vp = vb + r * rs + (h / G) * Dh;
      float* ah = acc + h * Dh;
      for (int64_t d = 0; d < Dh; ++d) ah[d] += p * static_cast<float>(vp[d]);
    }
}

// Online softmax over one block for each head: scores become exp(s - m_new), the running sum
// l and the accumulator are rescaled by exp(m_old - m_new).
static inline void softmax_update(float* sc, int64_t nr, int64_t nh, int64_t bs, int64_t Dh,
                                  float* m, float* l, float* acc) {
  for (int64_t h = 0; h < nh; ++h) {
    float* s = sc + h * bs;
    float mx = s[0];
    for (int64_t r = 1; r < nr; ++r) mx = std::max(mx, s[r]);
    const float mn = std::max(m[h], mx);
    const float corr = std::exp(m[h] - mn);  // 0 on the first block (m = -inf)
    m[h] = mn;
    float sum = 0.f;
    for (int64_t r = 0; r < nr; ++r) {
      s[r] = vexp(s[r] - mn);
      sum += s[r];
    }
    l[h] = l[h] * corr + sum;
    if (corr != 1.f) {
      float* a = acc + h * Dh;
      for (int64_t d = 0; d < Dh; ++d) a[d] *= corr;
    }
  }
}

// One load per 64-byte line of `bytes` at the start of each of `rows` rows `stride` elements
// apart: independent loads, so the CPU keeps many cache misses in flight at once.
template <typename C>
static inline void touch(const C* p, int64_t rows, int64_t stride, int64_t bytes) {
  for (int64_t r = 0; r < rows; ++r) {
    const volatile char* c = reinterpret_cast<const volatile char*>(p + r * stride);
    for (int64_t o = 0; o < bytes; o += 64) (void)c[o];
  }
}

// One work item = a query token i and `nkv` of its KV heads (all of them when there are
// enough tokens to keep the threads busy, else one: a single long sequence still uses every
// thread). One pass over the sequence's blocks, read in place: each block's rows are scored,
// softmaxed online and accumulated. A decode token's blocks come from DRAM (or L3): each is
// touched first, one load per line, so that all its misses are in flight at once; the
// compute loops alone left memory idle between misses (~7-8 GB/s). Before session 25 a
// memcpy into a local buffer did that job at the cost of a second pass over the rows, and
// software prefetch ahead of the loops was dropped because the CPU lets prefetches go when
// its miss buffers are full (slower than the copy once DRAM bounds). Since session 29 the
// next block is prefetched into L2 a few lines at a time through the arithmetic on the
// current one (NextBlock): memory and arithmetic overlap, and (since session 40) only the
// blocks nothing prefetched are touched.
// DH > 0 fixes the head size at compile time (64, 128: AVX2 paths where the CPU has them,
// AVX-512 ones for an fp32 cache where it has those);
// DH == 0 is generic.
// T: q/out dtype; C: cache dtype.

template <typename T, typename C, int DH>
static void attend(const T* q, int64_t q_stride, const C* kc, const C* vc, const int* bt,
                   const int64_t* seq_of, const int64_t* pos, T* out, int64_t ntok, int64_t H,
                   int64_t Hkv, int64_t dh_rt, int64_t bs, int64_t maxb, float scale) {
  const int64_t Dh = DH ? DH : dh_rt;
  const int64_t G = H / Hkv, row = Hkv * Dh, block_elems = bs * row;
  const int64_t split = ntok >= 2 * at::get_num_threads() ? 1 : Hkv;  // items per token
  const int64_t nkv = Hkv / split, rs = nkv * Dh, nh = nkv * G;
  at::parallel_for(0, ntok * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(nh * Dh), acc(nh * Dh), sc(nh * bs), m(nh), l(nh);
    bool primed = false;  // this item's first block was prefetched by the item before it
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / split, g0 = (item % split) * nkv;
      const int* table = bt + seq_of[i] * maxb;
      const int64_t n = pos[i] + 1, nblk = (n + bs - 1) / bs;
      const T* qi = q + i * q_stride + g0 * G * Dh;
      for (int64_t j = 0; j < nh * Dh; ++j) qf[j] = static_cast<float>(qi[j]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      // A token whose neighbours in the batch belong to its sequence (a prefill chunk) reads
      // blocks its neighbours just read (cache-resident). A lone token (decode) touches a
      // block's rows before reading them (see above) when nothing prefetched it. When whole
      // rows are read (split == 1, a decode batch of at least 2 tokens per thread), the block
      // after the current one (the token's next, or the first of the thread's next token) is
      // prefetched during the current one's arithmetic (NextBlock), and only a thread's first
      // block is touched: touching the prefetched ones too (until session 40) cost as much as
      // their arithmetic, measured on an Intel Sapphire Rapids VM (L3- and DRAM-resident K/V
      // alike: 1.09-1.19x faster without).
      const bool lone = !((i > 0 && seq_of[i - 1] == seq_of[i]) || (i + 1 < ntok && seq_of[i + 1] == seq_of[i]));
      const bool first_prefetched = primed;
      primed = false;
      for (int64_t b = 0; b < nblk; ++b) {
        const int64_t nr = std::min(bs, n - b * bs), off = static_cast<int64_t>(table[b]) * block_elems + g0 * Dh;
        const C* kp = kc + off;
        const C* vp = vc + off;
        NextBlock next;
        if (lone && (split > 1 || (b == 0 && !first_prefetched))) {  // not prefetched by NextBlock
          touch(kp, nr, row, rs * sizeof(C));
          touch(vp, nr, row, rs * sizeof(C));
        }
        if (lone && split == 1) {  // whole rows: a block's K (and V) is one run of bytes
          const int* t2 = table;
          int64_t b2 = b + 1, n2 = n;
          if (b2 == nblk && item + 1 < end) t2 = bt + seq_of[i + 1] * maxb, b2 = 0, n2 = pos[i + 1] + 1;
          primed = b2 == 0;  // the next item's first block
          if (b2 * bs < n2) {
            const int64_t off2 = static_cast<int64_t>(t2[b2]) * block_elems;
            next.set(kc + off2, vc + off2, std::min(bs, n2 - b2 * bs) * row * static_cast<int64_t>(sizeof(C)));
          }
        }
#ifdef STREAMRL_AVX512
        if constexpr (DH > 0 && std::is_same_v<C, float>) {
          scores_512<DH>(qf.data(), kp, row, nr, nkv, G, bs, sc.data(), next);
          softmax_update(sc.data(), nr, nh, bs, Dh, m.data(), l.data(), acc.data());
          values_512<DH>(sc.data(), vp, row, nr, nkv, G, bs, acc.data(), next);
          next.rest();
          continue;
        }
#endif
#ifdef STREAMRL_AVX2
        if constexpr (DH > 0 && kVec<C>) {
          scores_avx<C, DH>(qf.data(), kp, row, nr, nkv, G, bs, sc.data(), next);
          softmax_update(sc.data(), nr, nh, bs, Dh, m.data(), l.data(), acc.data());
          values_avx<C, DH>(sc.data(), vp, row, nr, nkv, G, bs, acc.data(), next);
          next.rest();
          continue;
        }
#endif
        scores_generic<C>(qf.data(), kp, row, nr, nkv, G, Dh, bs, sc.data());
        softmax_update(sc.data(), nr, nh, bs, Dh, m.data(), l.data(), acc.data());
        values_generic<C>(sc.data(), vp, row, nr, nkv, G, Dh, bs, acc.data());
        next.rest();
      }
      T* o = out + i * H * Dh + g0 * G * Dh;
      for (int64_t h = 0; h < nh; ++h) {
        const float inv = 1.f / l[h];
        for (int64_t d = 0; d < Dh; ++d) o[h * Dh + d] = static_cast<T>(acc[h * Dh + d] * inv);
      }
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
  // the indices the kernel follows, in range (a wrong one read past a buffer: a segfault, not an error)
  const int64_t ntok = q.size(0), nseq = block_tables.size(0), nb = k_cache.size(0);
  const int64_t span = block_tables.size(1) * k_cache.size(1);
  TORCH_CHECK(seq_of.numel() == ntok && positions.numel() == ntok && seq_of.is_contiguous() &&
              positions.is_contiguous(), "paged_attention: seq_of and positions need one entry per query row");
  const int64_t* so = seq_of.data_ptr<int64_t>();
  const int64_t* po = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < ntok; ++t) {
    TORCH_CHECK(so[t] >= 0 && so[t] < nseq, "paged_attention: seq_of[", t, "] = ", so[t], " is not a block_tables row");
    TORCH_CHECK(po[t] >= 0 && po[t] < span, "paged_attention: positions[", t, "] = ", po[t],
                " is outside its block table (", span, " slots)");
  }
  const int* bt = block_tables.data_ptr<int>();
  for (int64_t i = 0; i < block_tables.numel(); ++i)
    TORCH_CHECK(bt[i] >= 0 && bt[i] < nb, "paged_attention: block_tables holds block ", bt[i], " of ", nb);
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
