// Elementwise float math written so that `#pragma omp simd` loops vectorize it (no libm calls).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace vbatch {

// exp(x) within ~2 ulp for x in [-87, 88]: x = n ln2 + r with |r| <= ln2 / 2, a degree-6
// minimax polynomial for e^r, and 2^n built in the exponent bits. Inputs below -87 give ~0.
// lanes_exp below is the same computation on SIMD lanes.
constexpr float kExpMin = -87.0f;
constexpr float kExpMax = 88.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr int kExpPolyDegree = 6;
constexpr float kExpPoly[kExpPolyDegree] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// NOTE: always inlined, as are its users below: called out of line, it stops GCC from
// vectorizing the loop around it (gelu_erf's went scalar, 7x slower, in the -march=haswell build
// after an unrelated edit to this file changed GCC's inlining).
#pragma omp declare simd
__attribute__((always_inline)) inline float fast_exp(float x) {
  x = x < kExpMin ? kExpMin : (x > kExpMax ? kExpMax : x);
  const float n = __builtin_floorf(x * kLog2e + 0.5f);
  const float r = x - n * kLn2Hi - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int k = 1; k < kExpPolyDegree; ++k) p = p * r + kExpPoly[k];
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// silu(gate) * up = gate / (1 + e^-gate) * up: one definition for vbatch::silu_mul and the
// packed SwiGLU's epilogue, so that both give the same bits. Vector loops over it (or over
// another fast_exp of a clamped input) run under DenormalsFlushed.
#pragma omp declare simd
__attribute__((always_inline)) inline float silu_times(float gate, float up) {
  return gate / (1.0f + fast_exp(-gate)) * up;
}

// While in scope (and `active`), the calling thread's SSE/AVX arithmetic flushes denormal
// results and reads denormal inputs as zero; the thread's setting is restored at exit.
// NOTE: vectorized for AVX2, silu_times computes every lane's gate / (1 + e^88) (fast_exp's
// clamp, folded to a constant) before a blend drops it; for |gate| < 2 that quotient is
// denormal, and each such vector took a microcode assist: vbatch::silu_mul ran 7.0 against
// 0.62 ns an element (the -march=haswell build on the Intel Xeon). Only a result that is
// itself below 1.2e-38 changes.
class DenormalsFlushed {
 public:
  explicit DenormalsFlushed(bool active = true) {
#if defined(__SSE__)
    if (active) {
      saved_ = _mm_getcsr();
      _mm_setcsr(saved_ | kFlushToZero | kDenormalsAreZero);
      restore_ = true;
    }
#else
    (void)active;
#endif
  }
  ~DenormalsFlushed() {
#if defined(__SSE__)
    if (restore_) _mm_setcsr(saved_);
#endif
  }
  DenormalsFlushed(const DenormalsFlushed&) = delete;
  DenormalsFlushed& operator=(const DenormalsFlushed&) = delete;

 private:
  static constexpr unsigned kFlushToZero = 0x8000;
  static constexpr unsigned kDenormalsAreZero = 0x0040;
  unsigned saved_ = 0;
  bool restore_ = false;
};

// tanh(x) within ~2 ulp: an odd polynomial below |x| = 0.625 (where 1 - 2 / (e^2x + 1) would
// cancel), else that form through fast_exp (which saturates to +-1 for large |x|).
#pragma omp declare simd
__attribute__((always_inline)) inline float fast_tanh(float x) {
  const float a = x < 0.0f ? -x : x;
  if (a < 0.625f) {
    const float z = x * x;
    return ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
             1.33314422036e-1f) * z - 3.33332819422e-1f) * z * x + x;
  }
  const float r = 1.0f - 2.0f / (fast_exp(2.0f * a) + 1.0f);
  return x < 0.0f ? -r : r;
}

// Attention logit soft-capping (Gemma 2): cap * tanh(s / cap) on n scores, in place.
inline void softcap_scores(float* scores, int64_t n, float cap) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) scores[i] = cap * fast_tanh(scores[i] / cap);
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

// A vector of float32 lanes: one zmm (16 lanes) under AVX-512, one ymm (8) under AVX2 with FMA,
// else an array of 8 that `omp simd` vectorises. The tiled prefill kernel keeps one query token
// per lane.
#if defined(__AVX512F__)
constexpr int64_t kNumLanes = 16;
using Lanes = __m512;

inline Lanes lanes_zero() { return _mm512_setzero_ps(); }
inline Lanes lanes_set1(float x) { return _mm512_set1_ps(x); }
inline Lanes lanes_load(const float* p) { return _mm512_loadu_ps(p); }
inline void lanes_store(float* p, Lanes x) { _mm512_storeu_ps(p, x); }
inline Lanes lanes_add(Lanes a, Lanes b) { return _mm512_add_ps(a, b); }
inline Lanes lanes_sub(Lanes a, Lanes b) { return _mm512_sub_ps(a, b); }
inline Lanes lanes_mul(Lanes a, Lanes b) { return _mm512_mul_ps(a, b); }
inline Lanes lanes_max(Lanes a, Lanes b) { return _mm512_max_ps(a, b); }
inline Lanes lanes_fmadd(Lanes a, Lanes b, Lanes c) { return _mm512_fmadd_ps(a, b, c); }

// x with its first `n` lanes (0 <= n <= kNumLanes) set to `value`.
inline Lanes lanes_fill_first(Lanes x, int64_t n, float value) {
  const __mmask16 mask = n >= kNumLanes ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  return _mm512_mask_mov_ps(x, mask, _mm512_set1_ps(value));
}

// x with its lanes from `n` on (0 <= n <= kNumLanes) set to `value`.
inline Lanes lanes_fill_from(Lanes x, int64_t n, float value) {
  const __mmask16 keep = n >= kNumLanes ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  return _mm512_mask_mov_ps(x, static_cast<__mmask16>(~keep), _mm512_set1_ps(value));
}

inline Lanes lanes_min(Lanes a, Lanes b) { return _mm512_min_ps(a, b); }
// c - a * b
inline Lanes lanes_fnmadd(Lanes a, Lanes b, Lanes c) { return _mm512_fnmadd_ps(a, b, c); }
inline Lanes lanes_floor(Lanes x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}
// 2^n for lanes holding integers n in [-127, 128].
inline Lanes lanes_pow2(Lanes n) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kNumLanes = 8;
using Lanes = __m256;

inline Lanes lanes_zero() { return _mm256_setzero_ps(); }
inline Lanes lanes_set1(float x) { return _mm256_set1_ps(x); }
inline Lanes lanes_load(const float* p) { return _mm256_loadu_ps(p); }
inline void lanes_store(float* p, Lanes x) { _mm256_storeu_ps(p, x); }
inline Lanes lanes_add(Lanes a, Lanes b) { return _mm256_add_ps(a, b); }
inline Lanes lanes_sub(Lanes a, Lanes b) { return _mm256_sub_ps(a, b); }
inline Lanes lanes_mul(Lanes a, Lanes b) { return _mm256_mul_ps(a, b); }
inline Lanes lanes_max(Lanes a, Lanes b) { return _mm256_max_ps(a, b); }
inline Lanes lanes_fmadd(Lanes a, Lanes b, Lanes c) { return _mm256_fmadd_ps(a, b, c); }

inline Lanes lanes_fill_first(Lanes x, int64_t n, float value) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)), lane);
  return _mm256_blendv_ps(x, _mm256_set1_ps(value), _mm256_castsi256_ps(mask));
}

inline Lanes lanes_fill_from(Lanes x, int64_t n, float value) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  // lane >= n, as lane > n - 1
  const __m256i mask = _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(n - 1)));
  return _mm256_blendv_ps(x, _mm256_set1_ps(value), _mm256_castsi256_ps(mask));
}

inline Lanes lanes_min(Lanes a, Lanes b) { return _mm256_min_ps(a, b); }
inline Lanes lanes_fnmadd(Lanes a, Lanes b, Lanes c) { return _mm256_fnmadd_ps(a, b, c); }
inline Lanes lanes_floor(Lanes x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}
inline Lanes lanes_pow2(Lanes n) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#else
constexpr int64_t kNumLanes = 8;

struct Lanes {
  float v[kNumLanes];
};

template <typename F>
inline Lanes lanes_map(F f) {
  Lanes out;
#pragma omp simd
  for (int64_t i = 0; i < kNumLanes; ++i) out.v[i] = f(i);
  return out;
}

inline Lanes lanes_zero() { return lanes_map([](int64_t) { return 0.0f; }); }
inline Lanes lanes_set1(float x) { return lanes_map([x](int64_t) { return x; }); }
inline Lanes lanes_load(const float* p) { return lanes_map([p](int64_t i) { return p[i]; }); }
inline void lanes_store(float* p, const Lanes& x) { std::memcpy(p, x.v, sizeof(x.v)); }
inline Lanes lanes_add(const Lanes& a, const Lanes& b) {
  return lanes_map([&](int64_t i) { return a.v[i] + b.v[i]; });
}
inline Lanes lanes_sub(const Lanes& a, const Lanes& b) {
  return lanes_map([&](int64_t i) { return a.v[i] - b.v[i]; });
}
inline Lanes lanes_mul(const Lanes& a, const Lanes& b) {
  return lanes_map([&](int64_t i) { return a.v[i] * b.v[i]; });
}
inline Lanes lanes_max(const Lanes& a, const Lanes& b) {
  return lanes_map([&](int64_t i) { return a.v[i] > b.v[i] ? a.v[i] : b.v[i]; });
}
inline Lanes lanes_fmadd(const Lanes& a, const Lanes& b, const Lanes& c) {
  return lanes_map([&](int64_t i) { return a.v[i] * b.v[i] + c.v[i]; });
}
inline Lanes lanes_fill_first(const Lanes& x, int64_t n, float value) {
  return lanes_map([&](int64_t i) { return i < n ? value : x.v[i]; });
}
inline Lanes lanes_fill_from(const Lanes& x, int64_t n, float value) {
  return lanes_map([&](int64_t i) { return i >= n ? value : x.v[i]; });
}
inline Lanes lanes_exp(const Lanes& x) {
  return lanes_map([&](int64_t i) { return fast_exp(x.v[i]); });
}
#endif

// dst[c * dst_stride + r] = src[r * src_stride + c] for r, c < kNumLanes: one square block
// transposed in registers (AVX-512: 16 x 16, AVX2: 8 x 8), where a scalar loop costs a load and
// a store per value.
inline void lanes_transpose(const float* src, int64_t src_stride, float* dst,
                            int64_t dst_stride) {
#if defined(__AVX512F__)
  __m512 r[16], t[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * src_stride);
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // NOTE: after this, 128-bit lane k of r[4 * i + j] holds column 4 * k + j of rows 4i..4i+3.
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __m512 ab_lo = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x44);
    const __m512 ab_hi = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xEE);
    const __m512 cd_lo = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x44);
    const __m512 cd_hi = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xEE);
    _mm512_storeu_ps(dst + j * dst_stride, _mm512_shuffle_f32x4(ab_lo, cd_lo, 0x88));
    _mm512_storeu_ps(dst + (4 + j) * dst_stride, _mm512_shuffle_f32x4(ab_lo, cd_lo, 0xDD));
    _mm512_storeu_ps(dst + (8 + j) * dst_stride, _mm512_shuffle_f32x4(ab_hi, cd_hi, 0x88));
    _mm512_storeu_ps(dst + (12 + j) * dst_stride, _mm512_shuffle_f32x4(ab_hi, cd_hi, 0xDD));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 r[8], t[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * src_stride);
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  // NOTE: after this, 128-bit lane k of r[4 * i + j] holds column 4 * k + j of rows 4i..4i+3.
#pragma GCC unroll 2
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(dst + j * dst_stride, _mm256_permute2f128_ps(r[j], r[4 + j], 0x20));
    _mm256_storeu_ps(dst + (4 + j) * dst_stride, _mm256_permute2f128_ps(r[j], r[4 + j], 0x31));
  }
#else
  for (int64_t r = 0; r < kNumLanes; ++r) {
    for (int64_t c = 0; c < kNumLanes; ++c) dst[c * dst_stride + r] = src[r * src_stride + c];
  }
#endif
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// fast_exp on every lane, with the same reduction and polynomial.
inline Lanes lanes_exp(Lanes x) {
  x = lanes_max(lanes_min(x, lanes_set1(kExpMax)), lanes_set1(kExpMin));
  const Lanes n = lanes_floor(lanes_fmadd(x, lanes_set1(kLog2e), lanes_set1(0.5f)));
  Lanes r = lanes_fnmadd(n, lanes_set1(kLn2Hi), x);
  r = lanes_fnmadd(n, lanes_set1(kLn2Lo), r);
  Lanes p = lanes_set1(kExpPoly[0]);
  for (int k = 1; k < kExpPolyDegree; ++k) p = lanes_fmadd(p, r, lanes_set1(kExpPoly[k]));
  p = lanes_fmadd(lanes_mul(p, r), r, lanes_add(r, lanes_set1(1.0f)));
  return lanes_mul(p, lanes_pow2(n));
}
#endif

// What the two-phase decode kernel needs beyond the elementwise ops: loads of a head's partial
// last chunk, horizontal reductions, and the transposed sum of a step's per-row partial dots.
#if defined(__AVX512F__)
using LaneMask = __mmask16;

// The first n lanes (0 <= n).
inline LaneMask lanes_mask_first(int64_t n) {
  return n >= kNumLanes ? static_cast<LaneMask>(0xFFFF) : static_cast<LaneMask>((1u << n) - 1);
}
// Masked-off lanes read as 0 and touch no memory.
inline Lanes lanes_load_masked(const float* p, LaneMask mask) {
  return _mm512_maskz_loadu_ps(mask, p);
}
inline float lanes_reduce_max(Lanes x) { return _mm512_reduce_max_ps(x); }
inline float lanes_reduce_add(Lanes x) { return _mm512_reduce_add_ps(x); }
// p's lanes where x is not -inf, 0 where it is.
inline Lanes lanes_zero_where_neg_inf(Lanes x, Lanes p) {
  const __mmask16 keep =
      _mm512_cmp_ps_mask(x, _mm512_set1_ps(-__builtin_inff()), _CMP_NEQ_OQ);
  return _mm512_maskz_mov_ps(keep, p);
}

// Lane j of the result is the sum of v[j]'s lanes: 16 horizontal sums for the shuffles of ~3.
inline Lanes lanes_transpose_sum(const Lanes* v) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512 a = pairs[2 * i], b = pairs[2 * i + 1];
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 2; ++i) {
    const __m512 a = quads[2 * i], b = quads[2 * i + 1];
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
using LaneMask = __m256i;

inline LaneMask lanes_mask_first(int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(n, 8))),
                            lane);
}
inline Lanes lanes_load_masked(const float* p, LaneMask mask) {
  return _mm256_maskload_ps(p, mask);
}
inline float lanes_reduce_max(Lanes x) {
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}
inline float lanes_reduce_add(Lanes x) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}
inline Lanes lanes_zero_where_neg_inf(Lanes x, Lanes p) {
  return _mm256_and_ps(p, _mm256_cmp_ps(x, _mm256_set1_ps(-__builtin_inff()), _CMP_NEQ_OQ));
}

// Lane j of the result is the sum of v[j]'s lanes (8 vectors).
inline Lanes lanes_transpose_sum(const Lanes* v) {
  // NOTE: within each 128-bit half, hadd pairs up neighbours; after two rounds lane i of a half
  // holds the half's sum for vector i (of 4), and the last step adds the two halves.
  const __m256 low4 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 high4 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low4, high4, 0x20),
                       _mm256_permute2f128_ps(low4, high4, 0x31));
}
#endif

// cap * tanh(x / cap) on every lane.
inline Lanes lanes_softcap(Lanes x, float cap) {
  alignas(64) float buf[kNumLanes];
  lanes_store(buf, x);
  softcap_scores(buf, kNumLanes, cap);
  return lanes_load(buf);
}

// out[g * out_stride] = dot(q + g * q_stride, k, n) for g < G, each summed exactly as dot()
// sums it, with k read once for all G: the query heads of one GQA group score one key row.
template <int G>
inline void dot_group(const float* q, int64_t q_stride, const float* k, int64_t n, float* out,
                      int64_t out_stride) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if (n >= 8 && n % 8 == 0) {
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 key = _mm256_loadu_ps(k + i);
      for (int g = 0; g < G; ++g) {
        acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * q_stride + i), key, acc[g]);
      }
    }
    for (int g = 0; g < G; ++g) {
      __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc[g]), _mm256_extractf128_ps(acc[g], 1));
      half = _mm_add_ps(half, _mm_movehl_ps(half, half));
      half = _mm_add_ss(half, _mm_movehdup_ps(half));
      out[g * out_stride] = _mm_cvtss_f32(half);
    }
    return;
  }
#endif
  for (int g = 0; g < G; ++g) out[g * out_stride] = dot(q + g * q_stride, k, n);
}

// dot_group for a group size known only at run time.
inline void dot_heads(int64_t group, const float* q, int64_t q_stride, const float* k, int64_t n,
                      float* out, int64_t out_stride) {
  switch (group) {
    case 1: return dot_group<1>(q, q_stride, k, n, out, out_stride);
    case 2: return dot_group<2>(q, q_stride, k, n, out, out_stride);
    case 3: return dot_group<3>(q, q_stride, k, n, out, out_stride);
    case 4: return dot_group<4>(q, q_stride, k, n, out, out_stride);
    case 5: return dot_group<5>(q, q_stride, k, n, out, out_stride);
    case 6: return dot_group<6>(q, q_stride, k, n, out, out_stride);
    case 7: return dot_group<7>(q, q_stride, k, n, out, out_stride);
    case 8: return dot_group<8>(q, q_stride, k, n, out, out_stride);
    default:
      for (int64_t g = 0; g < group; ++g) out[g * out_stride] = dot(q + g * q_stride, k, n);
  }
}

// acc[d] += sum_j p[j] * rows[j * row_stride + d] for d < n, each d summed over j in order.
// Up to kMaxWeightedChunks SIMD chunks of acc stay in registers while the rows stream past, so
// their FMA chains run side by side (one chunk at a time, each row waited on the last FMA's
// latency: 8x slower on AVX2 at head_dim 64).
constexpr int kMaxWeightedChunks = 8;

template <int C>
inline void add_weighted_row_chunks(float* acc, const float* p, const float* rows,
                                    int64_t num_rows, int64_t row_stride) {
  Lanes sum[C];
  for (int c = 0; c < C; ++c) sum[c] = lanes_load(acc + c * kNumLanes);
  for (int64_t j = 0; j < num_rows; ++j) {
    const Lanes w = lanes_set1(p[j]);
    const float* row = rows + j * row_stride;
    for (int c = 0; c < C; ++c) sum[c] = lanes_fmadd(w, lanes_load(row + c * kNumLanes), sum[c]);
  }
  for (int c = 0; c < C; ++c) lanes_store(acc + c * kNumLanes, sum[c]);
}

template <int C>
inline void add_weighted_row_tail(float* acc, const float* p, const float* rows,
                                  int64_t num_rows, int64_t row_stride, int chunks) {
  if constexpr (C > 1) {
    if (chunks < C) {
      add_weighted_row_tail<C - 1>(acc, p, rows, num_rows, row_stride, chunks);
      return;
    }
  }
  add_weighted_row_chunks<C>(acc, p, rows, num_rows, row_stride);
}

inline void add_weighted_rows(float* acc, const float* p, const float* rows, int64_t num_rows,
                              int64_t row_stride, int64_t n) {
  constexpr int64_t kGroup = kMaxWeightedChunks * kNumLanes;
  int64_t d = 0;
  for (; d + kGroup <= n; d += kGroup) {
    add_weighted_row_chunks<kMaxWeightedChunks>(acc + d, p, rows + d, num_rows, row_stride);
  }
  const int chunks = static_cast<int>((n - d) / kNumLanes);
  if (chunks > 0) {
    add_weighted_row_tail<kMaxWeightedChunks - 1>(acc + d, p, rows + d, num_rows, row_stride,
                                                  chunks);
  }
  for (d += chunks * kNumLanes; d < n; ++d) {
    float sum = acc[d];
    for (int64_t j = 0; j < num_rows; ++j) sum += p[j] * rows[j * row_stride + d];
    acc[d] = sum;
  }
}

}  // namespace vbatch
