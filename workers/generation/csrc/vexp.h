#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// exp(x) in plain C++ that the compiler vectorises (Cephes expf: 2^n times a degree-6
// polynomial of the remainder; relative error ~2e-7); 0 below -87 (a masked logit gets no
// mass; no denormals), x clamped to 88 above. std::exp is a libm call per element: the
// SwiGLU of Qwen2.5-0.5B's 16-row decode step took 3.9 ms a step with it.
static inline float vexp(float x_in) {
  const float x = std::min(std::max(x_in, -87.f), 88.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x_in < -87.f ? 0.f : y * scale;
}
