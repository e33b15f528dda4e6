// Elementwise float math written so that `#pragma omp simd` loops vectorize it (no libm calls).
#pragma once

#include <cstdint>
#include <cstring>

namespace vbatch {

// exp(x) within ~2 ulp for x in [-87, 88]: x = n ln2 + r with |r| <= ln2 / 2, a degree-6
// minimax polynomial for e^r, and 2^n built in the exponent bits. Inputs below -87 give ~0.
#pragma omp declare simd
inline float fast_exp(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = __builtin_floorf(x * kLog2e + 0.5f);
  const float r = x - n * kLn2Hi - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// x / (1 + e^-x), the SiLU activation.
#pragma omp declare simd
inline float silu(float x) { return x / (1.0f + fast_exp(-x)); }

}  // namespace vbatch
