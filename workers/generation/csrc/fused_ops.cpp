#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// Rows per parallel chunk: ~32k elements, so a decode step's small tensors run on one thread
// (an OpenMP fork/join costs more than normalising 64 rows of 256).
static inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, row_elems)); }

// x: [T, D] (rows contiguous) -> w * x / sqrt(mean(x^2) + eps), as model.RMSNorm (fp32 math)
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.is_contiguous() && w.size(0) == x.size(1),
              "rms_norm: x must be [T, D] with contiguous rows, w [D]");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t T = x.size(0), D = x.size(1), xs = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, grain(D), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* r = xp + t * xs;
        float ss = 0.f;
        for (int64_t d = 0; d < D; ++d) { const float v = static_cast<float>(r[d]); ss += v * v; }
        const float inv = 1.f / std::sqrt(ss / D + static_cast<float>(eps));
        scalar_t* o = op + t * D;
        for (int64_t d = 0; d < D; ++d)
          o[d] = static_cast<scalar_t>(static_cast<float>(wp[d]) *
                                       static_cast<float>(static_cast<scalar_t>(static_cast<float>(r[d]) * inv)));
      }
    });
  });
  return out;
}

// gu: [T, 2I] (gate | up, rows contiguous) -> silu(gate) * up: [T, I]; fp32 math over chunks
// of 256 columns converted into local buffers (vectorised loops, vexp).
torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && gu.size(1) % 2 == 0, "silu_mul: gu must be [T, 2I]");
  const int64_t T = gu.size(0), I = gu.size(1) / 2, gs = gu.stride(0);
  auto out = torch::empty({T, I}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gu.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t chunks = (I + 255) / 256;
    at::parallel_for(0, T * chunks, std::max<int64_t>(1, grain(2 * I) * chunks), [&](int64_t b, int64_t e) {
      float g[256], u[256];
      for (int64_t item = b; item < e; ++item) {
        const int64_t t = item / chunks, j0 = (item % chunks) * 256, n = std::min<int64_t>(256, I - j0);
        const scalar_t* gr = gp + t * gs + j0;
        const scalar_t* ur = gr + I;
        for (int64_t j = 0; j < n; ++j) { g[j] = static_cast<float>(gr[j]); u[j] = static_cast<float>(ur[j]); }
        for (int64_t j = 0; j < n; ++j) g[j] = g[j] / (1.f + vexp(-g[j])) * u[j];
        scalar_t* o = op + t * I + j0;
        for (int64_t j = 0; j < n; ++j) o[j] = static_cast<scalar_t>(g[j]);
      }
    });
  });
  return out;
}

// qkv: [T, >= N * Dh] (rows contiguous): its first N heads (q and k) rotated in place.
// cs: [T, 2, Dh] cos and sign-folded sin: x * cos + swap_halves(x) * sin_s (HF rotate_half)
void rope_(torch::Tensor qkv, torch::Tensor cs, int64_t n_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && cs.is_contiguous() && cs.dim() == 3 &&
              cs.size(0) == qkv.size(0) && cs.size(1) == 2 && n_heads * cs.size(2) <= qkv.size(1) &&
              cs.scalar_type() == qkv.scalar_type(), "rope_: bad shapes");
  const int64_t T = qkv.size(0), Dh = cs.size(2), half = Dh / 2, qs = qkv.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_", [&] {
    scalar_t* xp = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cs.data_ptr<scalar_t>();
    at::parallel_for(0, T, grain(n_heads * Dh), [&](int64_t b, int64_t e) {
      // 16-bit: a token's cos/sin converted once and each head's row through an fp32 buffer
      // (converting per element per head took 24 us for Qwen2.5-0.5B's 16 rows, this 7-9 us)
      std::vector<float> cf(Dh), sf(Dh), xf(Dh);
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* c = cp + t * 2 * Dh;
        const scalar_t* s = c + Dh;
        if (sizeof(scalar_t) >= 4) {  // fp32/fp64 in place (AT_DISPATCH's lambda compiles both arms)
          for (int64_t h = 0; h < n_heads; ++h) {
            scalar_t* x = xp + t * qs + h * Dh;
            for (int64_t d = 0; d < half; ++d) {
              const scalar_t x1 = x[d], x2 = x[d + half];
              x[d] = x1 * c[d] + x2 * s[d];
              x[d + half] = x2 * c[d + half] + x1 * s[d + half];
            }
          }
        } else {
          for (int64_t d = 0; d < Dh; ++d) { cf[d] = static_cast<float>(c[d]); sf[d] = static_cast<float>(s[d]); }
          for (int64_t h = 0; h < n_heads; ++h) {
            scalar_t* x = xp + t * qs + h * Dh;
            for (int64_t d = 0; d < Dh; ++d) xf[d] = static_cast<float>(x[d]);
            for (int64_t d = 0; d < half; ++d) {
              x[d] = static_cast<scalar_t>(xf[d] * cf[d] + xf[d + half] * sf[d]);
              x[d + half] = static_cast<scalar_t>(xf[d + half] * cf[d + half] + xf[d] * sf[d + half]);
            }
          }
        }
      }
    });
  });
}

// One token per row of logits [B, V] (contiguous; fp32 math), as sampler.Sampler's draw without
// top-k/top-p: the EOS columns eos [E] get no mass in rows with block[r]; greedy[r]: argmax
// (first of equal maxima, as torch), log-prob at temperature 1; else logits / temps[r], the
// token whose cumulative probability (fp64 running sum) first exceeds u[r] times the total,
// its log-prob at that temperature. One vectorised pass for the max, one for exp and the
// sum, a scan for the draw; no [B, V] temporaries (torch composes it from ~12 ops).
// A masked logit: finite (the build's -ffast-math assumes no infinities), exp() of it is 0.
constexpr float kMasked = -1e30f;

std::vector<torch::Tensor> sample(torch::Tensor logits, torch::Tensor eos, torch::Tensor block,
                                  torch::Tensor greedy, torch::Tensor temps, torch::Tensor u) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "sample: logits must be contiguous [B, V]");
  const int64_t B = logits.size(0), V = logits.size(1), E = eos.numel();
  TORCH_CHECK(eos.dtype() == torch::kInt64 && eos.is_contiguous(), "sample: eos must be int64");
  TORCH_CHECK(block.dtype() == torch::kBool && greedy.dtype() == torch::kBool && block.numel() == B &&
              greedy.numel() == B, "sample: block and greedy must be bool [B]");
  TORCH_CHECK(temps.dtype() == torch::kFloat && temps.numel() == B && u.dtype() == torch::kDouble &&
              u.numel() == B, "sample: temps must be fp32 [B] and u fp64 [B]");
  const int64_t* ep = eos.data_ptr<int64_t>();
  for (int64_t j = 0; j < E; ++j) TORCH_CHECK(ep[j] >= 0 && ep[j] < V, "sample: eos id ", ep[j], " outside the vocabulary");
  auto ids = torch::empty({B}, logits.options().dtype(torch::kInt64));
  auto logp = torch::empty({B}, logits.options().dtype(torch::kFloat));
  const bool* bp = block.data_ptr<bool>();
  const bool* gp = greedy.data_ptr<bool>();
  const float* tp = temps.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* op = logp.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "sample", [&] {
    const scalar_t* lp = logits.data_ptr<scalar_t>();
    at::parallel_for(0, B, grain(V), [&](int64_t b, int64_t e) {
      std::vector<float> x(V), ex(V), cs(V / 16);
      for (int64_t r = b; r < e; ++r) {
        for (int64_t j = 0; j < V; ++j) x[j] = static_cast<float>(lp[r * V + j]);
        if (bp[r])
          for (int64_t j = 0; j < E; ++j) x[ep[j]] = kMasked;
        float masked_at = kMasked;  // what a masked logit is after the scaling below, rounded as it is
        if (!gp[r] && tp[r] != 1.f) {
          const float inv_t = 1.f / tp[r];
          for (int64_t j = 0; j < V; ++j) x[j] *= inv_t;
          masked_at *= inv_t;
        }
        // the max, and in the same pass whether a logit is NaN or +inf (a bad weight): then the
        // row's log-prob is NaN, as torch's log_softmax gives it (the trainer refuses such a
        // sample). A bit test: -ffast-math assumes finite floats and folds isnan away, and its
        // max / argmax would hide the NaN
        float mx = x[0];
        bool bad = false;
        for (int64_t j = 0; j < V; ++j) {
          mx = std::max(mx, x[j]);
          uint32_t bits;
          std::memcpy(&bits, &x[j], sizeof bits);
          bad |= (bits & 0x7f800000u) == 0x7f800000u && bits != 0xff800000u;  // all but -inf
        }
        // no token with mass: every one masked (an EOS blocked below min_tokens, the rest -inf)
        // or -inf: the blocked EOS was drawn with log-prob 0 (torch's path gives NaN; review, s53)
        bad |= !(mx > masked_at);
        if (bad) {
          ip[r] = 0;
          uint32_t qnan = 0x7fc00000u;
          std::memcpy(&op[r], &qnan, sizeof qnan);
          continue;
        }
        float sum = 0.f;  // vectorised: partial sums in fp32, as torch's log_softmax
        for (int64_t j = 0; j < V; ++j) {
          ex[j] = vexp(x[j] - mx);
          sum += ex[j];
        }
        const float lse = mx + std::log(sum);
        int64_t tok = 0;
        if (gp[r]) {
          while (tok < V - 1 && x[tok] != mx) ++tok;  // the first maximum (bounded: NaN logits)
        } else {  // the first token whose running sum (fp64, over chunks of 16 first) exceeds u * total
          // total: summed as the scan sums, from the same chunk sums cs (the fp32 sum above can
          // round past it: with u near 1 no token reached the target and the draw fell on the
          // last id, whatever its mass)
          const int64_t nc = V / 16;
          double total = 0.0;
          for (int64_t c = 0; c < nc; ++c) {
            float s = 0.f;
            for (int k = 0; k < 16; ++k) s += ex[c * 16 + k];
            cs[c] = s;
            total += s;
          }
          for (int64_t j = nc * 16; j < V; ++j) total += ex[j];
          const double target = up[r] * total;
          double cum = 0.0;
          int64_t c = 0;
          for (; c < nc && cum + cs[c] <= target; ++c) cum += cs[c];
          const int64_t j0 = c * 16;
          tok = -1;
          for (int64_t j = j0; j < V; ++j) {
            cum += ex[j];
            if (cum > target) { tok = j; break; }
          }
          if (tok < 0) {  // (rounding: the draw is at the very end) the last token with any mass
            tok = V - 1;
            while (tok > 0 && !(ex[tok] > 0.f)) --tok;
          }
        }
        ip[r] = tok;
        op[r] = x[tok] - lse;
      }
    });
  });
  return {ids, logp};
}

// k, v: [T, Hkv, Dh] (each token's heads contiguous; any token stride, e.g. views of a fused
// qkv projection) written into the caches [num_blocks, block_size, Hkv, Dh] at slots [T]: a
// row copy per token (what index_copy_ does, without its strided-source path: ~25 us a call
// at decode sizes, this ~1 us). Cache dtype = k's, or bf16/fp16 under fp32 k (rounded to nearest even).
template <typename S, typename C>
static void write_rows(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& kc, torch::Tensor& vc,
                       const int64_t* slots, int64_t row) {
  const int64_t T = k.size(0), ks = k.stride(0), vs = v.stride(0);
  const S* kp = k.data_ptr<S>();
  const S* vp = v.data_ptr<S>();
  C* kcp = kc.data_ptr<C>();
  C* vcp = vc.data_ptr<C>();
  for (int64_t t = 0; t < T; ++t) {
    C* kd = kcp + slots[t] * row;
    C* vd = vcp + slots[t] * row;
    if constexpr (std::is_same_v<S, C>) {
      std::memcpy(kd, kp + t * ks, row * sizeof(C));
      std::memcpy(vd, vp + t * vs, row * sizeof(C));
    } else {
      for (int64_t j = 0; j < row; ++j) {
        kd[j] = static_cast<C>(kp[t * ks + j]);
        vd[j] = static_cast<C>(vp[t * vs + j]);
      }
    }
  }
}

void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slots) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "write_kv: the caches must be contiguous [num_blocks, block_size, Hkv, Dh] of one dtype");
  const int64_t Hkv = k_cache.size(2), Dh = k_cache.size(3), row = Hkv * Dh;
  for (const auto& x : {k, v})
    TORCH_CHECK(x.dim() == 3 && x.size(1) == Hkv && x.size(2) == Dh && x.stride(2) == 1 && x.stride(1) == Dh &&
                x.scalar_type() == k.scalar_type() && x.size(0) == k.size(0),
                "write_kv: k and v must be [T, Hkv, Dh] with each token's heads contiguous");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.is_contiguous() && slots.numel() == k.size(0),
              "write_kv: slots must be contiguous int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t nslots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < nslots, "write_kv: slot ", sp[t], " of token ", t, " is outside the cache (",
                nslots, " slots)");
  const auto cd = k_cache.scalar_type(), sd = k.scalar_type();
  if (sd == cd) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cd, "write_kv", [&] {
      write_rows<scalar_t, scalar_t>(k, v, k_cache, v_cache, sp, row);
    });
  } else if (sd == at::kFloat && cd == at::kBFloat16) {
    write_rows<float, c10::BFloat16>(k, v, k_cache, v_cache, sp, row);
  } else if (sd == at::kFloat && cd == at::kHalf) {
    write_rows<float, c10::Half>(k, v, k_cache, v_cache, sp, row);
  } else {
    TORCH_CHECK(false, "write_kv: a ", cd, " cache under ", sd, " k/v is not supported");
  }
}

// x @ w^T + add, add: none, a bias [N] or a residual [M, N]. The N output columns are split
// into one GEMM per thread (multiples of 16 columns; each runs single-threaded inside the
// parallel region). At decode sizes (M ~ 64) MKL's own threading of one GEMM splits worse.
torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> add) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.size(1) == x.size(1) && w.is_contiguous(),
              "linear: x must be [M, K] and w a contiguous [N, K]");
  const int64_t M = x.size(0), N = w.size(0);
  if (add.has_value())
    TORCH_CHECK(add->dim() == 1 ? add->size(0) == N : (add->dim() == 2 && add->size(0) == M && add->size(1) == N),
                "linear: add must be a bias [N] or a residual [M, N]");
  const int64_t threads = at::get_num_threads();
  if (threads < 2 || N < 32 * threads) {
    return add.has_value() ? at::addmm(*add, x, w.t()) : at::mm(x, w.t());
  }
  auto out = torch::empty({M, N}, x.options());
  const int64_t step = ((N + threads - 1) / threads + 15) / 16 * 16;
  const int64_t chunks = (N + step - 1) / step;
  const at::ThreadLocalState caller;  // grad / inference mode are per thread: the workers take the caller's
  at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
    at::ThreadLocalStateGuard guard(caller);
    for (int64_t c = b; c < e; ++c) {
      const int64_t n0 = c * step, n = std::min(step, N - n0);
      auto oc = out.narrow(1, n0, n);
      auto wc = w.narrow(0, n0, n).t();
      if (add.has_value()) {
        at::addmm_out(oc, add->dim() == 1 ? add->narrow(0, n0, n) : add->narrow(1, n0, n), x, wc);
      } else {
        at::mm_out(oc, x, wc);
      }
    }
  });
  return out;
}
