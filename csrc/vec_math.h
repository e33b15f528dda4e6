// Elementwise float math written so that `#pragma omp simd` loops vectorize it (no libm calls).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

// sum(a[i] * b[i]); SIMD with one horizontal reduction at the end (an `omp simd` reduction
// compiles to a chain of scalar adds here, which dominated the attention scores).
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.0f;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    }
    sum = _mm512_reduce_add_ps(acc);
  }
#elif defined(__AVX2__)
  if (n >= 8) {
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    }
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    sum = _mm_cvtss_f32(half);
  }
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// acc[d] += sum_j p[j] * rows[j * row_stride + d] for d < n: each SIMD chunk of acc stays in a
// register while every row adds into it.
inline void add_weighted_rows(float* acc, const float* p, const float* rows, int64_t num_rows,
                              int64_t row_stride, int64_t n) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= n; d += 16) {
    __m512 sum = _mm512_loadu_ps(acc + d);
    for (int64_t j = 0; j < num_rows; ++j) {
      sum = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(rows + j * row_stride + d), sum);
    }
    _mm512_storeu_ps(acc + d, sum);
  }
#elif defined(__AVX2__)
  for (; d + 8 <= n; d += 8) {
    __m256 sum = _mm256_loadu_ps(acc + d);
    for (int64_t j = 0; j < num_rows; ++j) {
      sum = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(rows + j * row_stride + d), sum);
    }
    _mm256_storeu_ps(acc + d, sum);
  }
#endif
  for (; d < n; ++d) {
    float sum = acc[d];
    for (int64_t j = 0; j < num_rows; ++j) sum += p[j] * rows[j * row_stride + d];
    acc[d] = sum;
  }
}

}  // namespace vbatch
