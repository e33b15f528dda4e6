// Exact int8 x int8 -> int32 GEMM for CPUs whose library int8 GEMMs are inexact or slow.
//
// Without VNNI, torch's `_int_mm` (oneDNN) and FBGEMM multiply u8 x s8 bytes with vpmaddubsw,
// which adds each pair of products in saturating int16: full-range values overflow it and the
// sums come out wrong. Here each signed activation byte a is split into |a| (the unsigned
// operand) and its sign, moved onto the weight byte (vpsignb under AVX2, a masked negation under
// AVX-512), so every product is |a| * (+-w) with |a| <= 128 and |w| <= 127: a pair sums to at
// most 2 * 128 * 127 = 32512, inside int16, and the int32 sums are exact. The weight must stay
// off -128, whose negation overflows (pack_int8_weight checks); any activation byte is fine.
// With AVX512-VNNI one vpdpbusd adds the four products of a lane straight into int32.
//
// int8_linear is a whole float32 linear layer in one call: it quantizes the rows itself and
// scales the sums back to float32 (and, for a gated MLP, applies SwiGLU) while they are still
// in registers. Under VNNI its rows are offset by +128 to unsigned bytes, vpdpbusd's own
// operand, and the offset's share (128 x each weight column's sum) comes off in the epilogue:
// one instruction per product group instead of three. Without VNNI its rows and weights are
// int16 pairs in the same lanes (pack_int8_linear), multiplied and paired by vpmaddwd with no
// saturation: two instructions per group of two against five per group of four, and weights
// at half the bytes of float32.
//
// A weight [N, K] is packed once into panels of int8_panel_cols() output columns as
// [panels, K / 4, cols, 4]: one vector load gives a vector's columns four k values each, and an
// activation row's four bytes at that k are broadcast to every column (the VNNI layout). Each
// micro-kernel call keeps R rows x 2 vectors of int32 accumulators in registers.
#include "int8_gemm.h"

#include "../vec_math.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>

#if defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace vbatch {
namespace {

constexpr int64_t kGroup = 4;  // bytes of one column in a vector lane: 4 int8 or 2 int16 k values

#if defined(__AVX512BW__)
constexpr int64_t kVecCols = 16;
constexpr int kRowBlock = 8;
using IVec = __m512i;
using Signs = __mmask64;
inline IVec ivec_zero() { return _mm512_setzero_si512(); }
inline IVec ivec_load(const int8_t* p) { return _mm512_loadu_si512(p); }
inline void ivec_store(int32_t* p, IVec x) { _mm512_storeu_si512(p, x); }
inline IVec ivec_broadcast4(int32_t bytes) { return _mm512_set1_epi32(bytes); }
inline IVec ivec_abs8(IVec a) { return _mm512_abs_epi8(a); }
inline Signs signs_of(IVec a) { return _mm512_movepi8_mask(a); }
inline IVec with_signs(IVec w, Signs negative) {
  return _mm512_mask_sub_epi8(w, negative, _mm512_setzero_si512(), w);
}
inline IVec dot4(IVec acc, IVec magnitudes, IVec signed_w) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, magnitudes, signed_w);
#else
  const IVec pairs = _mm512_maddubs_epi16(magnitudes, signed_w);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}
#elif defined(__AVX2__)
constexpr int64_t kVecCols = 8;
constexpr int kRowBlock = 4;
using IVec = __m256i;
using Signs = __m256i;
inline IVec ivec_zero() { return _mm256_setzero_si256(); }
inline IVec ivec_load(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const IVec*>(p)); }
inline void ivec_store(int32_t* p, IVec x) { _mm256_storeu_si256(reinterpret_cast<IVec*>(p), x); }
inline IVec ivec_broadcast4(int32_t bytes) { return _mm256_set1_epi32(bytes); }
inline IVec ivec_abs8(IVec a) { return _mm256_abs_epi8(a); }
inline Signs signs_of(IVec a) { return a; }
inline IVec with_signs(IVec w, Signs a) { return _mm256_sign_epi8(w, a); }
inline IVec dot4(IVec acc, IVec magnitudes, IVec signed_w) {
  const IVec pairs = _mm256_maddubs_epi16(magnitudes, signed_w);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#else
constexpr int64_t kVecCols = 8;
constexpr int kRowBlock = 4;
#endif

// How a row's values and a panel's weights fill a 4-byte lane (one k group of one column).
// kSigned: four int8 values, multiplied as |a| times the weight with a's sign (exact without
// VNNI, above). kOffset (VNNI): four bytes offset by +128 to unsigned, vpdpbusd's own
// operands, one instruction. kWide (AVX2 or AVX-512 without VNNI): two int16 values each, rows
// and weights widened, so vpmaddwd multiplies and pairs them with no saturation (two instructions
// against five) from weights half the float32 bytes.
enum class Lanes4 { kSigned, kOffset, kWide };
template <Lanes4 E>
using LanesTag = std::integral_constant<Lanes4, E>;

#if defined(__AVX512BW__) || defined(__AVX2__)
inline IVec dot4_rows(IVec acc, IVec x, IVec w, LanesTag<Lanes4::kSigned>) {
  return dot4(acc, ivec_abs8(x), with_signs(w, signs_of(x)));
}
inline IVec dot4_rows(IVec acc, IVec x, IVec w, LanesTag<Lanes4::kWide>) {
#if defined(__AVX512BW__)
  return _mm512_add_epi32(acc, _mm512_madd_epi16(x, w));
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w));
#endif
}
#endif
#if defined(__AVX512VNNI__)
inline IVec dot4_rows(IVec acc, IVec x, IVec w, LanesTag<Lanes4::kOffset>) {
  return _mm512_dpbusd_epi32(acc, x, w);
}
// The encoding int8_linear runs here.
constexpr Lanes4 kLinearLanes = Lanes4::kOffset;
#elif defined(__AVX512BW__) || defined(__AVX2__)
constexpr Lanes4 kLinearLanes = Lanes4::kWide;
#else
constexpr Lanes4 kLinearLanes = Lanes4::kSigned;
#endif
// k values in one lane.
constexpr int64_t lane_values(Lanes4 e) { return e == Lanes4::kWide ? 2 : 4; }
constexpr int32_t kRowOffset = 128;
constexpr float kInt8Max = 127.0f;

constexpr int64_t kPanelCols = 2 * kVecCols;
constexpr int64_t kPanelGroupBytes = kPanelCols * kGroup;
// NOTE: the activation rows one pass over a thread's panels serves stay in L2 beside the panel.
constexpr int64_t kRowBlockBytes = 256 * 1024;

inline int32_t load4(const int8_t* p) {
  int32_t bytes;
  std::memcpy(&bytes, p, sizeof(bytes));
  return bytes;
}

// A row block's int32 sums over a panel: tile[r * kPanelCols + c] = sum_k a[r, k] * panel
// column c for r < R, `a` and the panel encoded as E says (`lda` in bytes). Under kOffset the
// sums carry 128 x the weight column's sum, which int8_linear takes off.
template <int R, Lanes4 E>
void dot_block(const int8_t* a, int64_t lda, const int8_t* panel, int64_t groups,
               int32_t* tile) {
#if defined(__AVX512BW__) || defined(__AVX2__)
  IVec acc0[R], acc1[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = ivec_zero();
  for (int64_t g = 0; g < groups; ++g) {
    const IVec w0 = ivec_load(panel + g * kPanelGroupBytes);
    const IVec w1 = ivec_load(panel + g * kPanelGroupBytes + kVecCols * kGroup);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const IVec x = ivec_broadcast4(load4(a + r * lda + g * kGroup));
      acc0[r] = dot4_rows(acc0[r], x, w0, LanesTag<E>{});
      acc1[r] = dot4_rows(acc1[r], x, w1, LanesTag<E>{});
    }
  }
  for (int r = 0; r < R; ++r) {
    ivec_store(tile + r * kPanelCols, acc0[r]);
    ivec_store(tile + r * kPanelCols + kVecCols, acc1[r]);
  }
#else
  static_assert(E == Lanes4::kSigned, "only signed bytes without SIMD");
  for (int r = 0; r < R; ++r) {
    int32_t* sums = tile + r * kPanelCols;
    std::fill(sums, sums + kPanelCols, 0);
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* x = a + r * lda + g * kGroup;
      const int8_t* w = panel + g * kPanelGroupBytes;
      for (int64_t c = 0; c < kPanelCols; ++c) {
        for (int64_t j = 0; j < kGroup; ++j) sums[c] += int32_t{x[j]} * int32_t{w[c * kGroup + j]};
      }
    }
  }
#endif
}

// dot_block for `rows` <= R rows, then epilogue(tile, rows).
template <int R, Lanes4 E, typename Epilogue>
void rows_tail(const int8_t* a, int64_t lda, const int8_t* panel, int64_t groups, int64_t rows,
               const Epilogue& epilogue) {
  if constexpr (R > 1) {
    if (rows < R) {
      rows_tail<R - 1, E>(a, lda, panel, groups, rows, epilogue);
      return;
    }
  }
  alignas(64) int32_t tile[R * kPanelCols];
  dot_block<R, E>(a, lda, panel, groups, tile);
  epilogue(tile, rows);
}

// Visits panels [first_panel, end_panel) of the M rows of `a` (`row_bytes` each, encoded as E)
// in row blocks that stay in L2 while the panels stream past them, in parallel over panels:
// epilogue(tile, rows, m, p) after each kRowBlock rows from m through panel p.
template <Lanes4 E, typename Epilogue>
void walk_panels(const int8_t* a, int64_t M, int64_t row_bytes, const int8_t* packed,
                 int64_t first_panel, int64_t end_panel, const Epilogue& epilogue) {
  const int64_t groups = row_bytes / kGroup;
  const int64_t panel_bytes = groups * kPanelGroupBytes;
  const int64_t block_rows = std::max<int64_t>(
      kRowBlock, kRowBlockBytes / std::max<int64_t>(row_bytes, 1) / kRowBlock * kRowBlock);
  at::parallel_for(first_panel, end_panel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
      const int64_t m_end = std::min(M, m0 + block_rows);
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t m = m0; m < m_end; m += kRowBlock) {
          rows_tail<kRowBlock, E>(
              a + m * row_bytes, row_bytes, packed + p * panel_bytes, groups,
              std::min<int64_t>(kRowBlock, m_end - m),
              [&](const int32_t* tile, int64_t rows) { epilogue(tile, rows, m, p); });
        }
      }
    }
  });
}

// One output of an int8 linear: its exact int32 sum back in float32 (one definition for
// int8_linear and int8_scale_sums, so that the two give the same bits).
#pragma omp declare simd
inline float scaled_sum(int32_t sum, float row_scale, float col_scale, float col_bias) {
  return static_cast<float>(sum) * row_scale * col_scale + col_bias;
}

// The element type of rows and packed weights encoded as E.
template <Lanes4 E>
using LaneValue = std::conditional_t<E == Lanes4::kWide, int16_t, int8_t>;

// Each row of x [M, K] as int8 values by its largest magnitude (scale = peak / 127, rounded half
// to even, as torch.round), into q [M, k_padded] of LaneValue<E> (zeros past K; under kOffset
// each byte holds the value plus 128 as an unsigned byte) and scales [M].
template <Lanes4 E>
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t k_padded, LaneValue<E>* q,
                   float* scales) {
  constexpr int32_t kOffset = E == Lanes4::kOffset ? kRowOffset : 0;
  constexpr int64_t kGrainRows = 64;
  at::parallel_for(0, M, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
      float peak = 0.0f;
#pragma omp simd reduction(max : peak)
      for (int64_t k = 0; k < K; ++k) peak = std::max(peak, std::fabs(row[k]));
      const float scale = std::max(peak, 1e-12f) / static_cast<float>(kInt8Max);
      scales[m] = scale;
      LaneValue<E>* out = q + m * k_padded;
      for (int64_t k = 0; k < K; ++k) {
        const float v = std::nearbyint(row[k] / scale);
        // NOTE: written so that NaN lands on a bound instead of an undefined conversion.
        const float clamped = v >= -kInt8Max ? (v <= kInt8Max ? v : kInt8Max) : -kInt8Max;
        const int32_t value = static_cast<int32_t>(clamped) + kOffset;
        out[k] = static_cast<LaneValue<E>>(static_cast<std::make_unsigned_t<LaneValue<E>>>(value));
      }
      std::fill(out + K, out + k_padded, static_cast<LaneValue<E>>(kOffset));
    }
  });
}

}  // namespace

int64_t int8_panel_cols() { return kPanelCols; }

at::Tensor int8_rows_padded(const at::Tensor& a) {
  const int64_t K = a.size(1), padded = (K + kGroup - 1) / kGroup * kGroup;
  return padded == K ? a.contiguous() : at::constant_pad_nd(a, {0, padded - K});
}

void int8_packed_mm_into(const int8_t* a, int64_t M, int64_t k_padded, const int8_t* packed,
                         int64_t N, int64_t col_begin, int64_t col_end, int32_t* out,
                         int64_t ldo) {
  const int64_t last_col = std::min(col_end, N);
  walk_panels<Lanes4::kSigned>(
      a, M, k_padded, packed, col_begin / kPanelCols, (last_col + kPanelCols - 1) / kPanelCols,
      [&](const int32_t* tile, int64_t rows, int64_t m, int64_t p) {
        const int64_t c0 = p * kPanelCols;
        const int64_t cols = std::min(kPanelCols, last_col - c0);
        for (int64_t r = 0; r < rows; ++r) {
          std::copy(tile + r * kPanelCols, tile + r * kPanelCols + cols,
                    out + (m + r) * ldo + (c0 - col_begin));
        }
      });
}

namespace {

// weight [N, K] int8 -> [panels, ceil(K / V), int8_panel_cols(), V] of LaneValue<E> (V =
// lane_values(E)), zeros past N and K.
template <Lanes4 E>
at::Tensor pack_lanes(const at::Tensor& weight, const char* op) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.device().is_cpu(),
              op, ": weight must be a 2-D int8 CPU tensor, got ", weight.sizes(), " ",
              weight.scalar_type());
  constexpr int64_t kValues = lane_values(E);
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t groups = (K + kValues - 1) / kValues, panels = (N + kPanelCols - 1) / kPanelCols;
  const auto dtype = E == Lanes4::kWide ? at::kShort : at::kChar;
  at::Tensor packed = at::zeros({panels, groups, kPanelCols, kValues}, w.options().dtype(dtype));
  const int8_t* src = w.const_data_ptr<int8_t>();
  auto* dst = static_cast<LaneValue<E>*>(packed.mutable_data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < kPanelCols && p * kPanelCols + c < N; ++c) {
        const int8_t* row = src + (p * kPanelCols + c) * K;
        LaneValue<E>* column = dst + (p * groups * kPanelCols + c) * kValues;
        for (int64_t k = 0; k < K; ++k) {
          column[(k / kValues) * kPanelCols * kValues + k % kValues] = row[k];
        }
      }
    }
  });
  return packed;
}

// weight [N, K] int8 -> the greedy screen's and int8_packed_mm's panels (signed bytes).
at::Tensor pack_int8_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.numel() == 0 || weight.min().item<int8_t>() >= -127,
              "pack_int8_weight: weight must hold values in [-127, 127] (-128's negation "
              "overflows)");
  return pack_lanes<Lanes4::kSigned>(weight, "pack_int8_weight");
}

// weight [N, K] int8 -> int8_linear's panels, in the encoding it runs in this build.
at::Tensor pack_int8_linear(const at::Tensor& weight) {
  return pack_lanes<kLinearLanes>(weight, "pack_int8_linear");
}

int64_t int8_linear_lane_values() { return lane_values(kLinearLanes); }

// a [M, K] int8 @ w^T -> [M, out_features] int32, exactly; packed = pack_int8_weight(w).
at::Tensor int8_packed_mm(const at::Tensor& a, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == at::kChar && a.device().is_cpu(),
              "int8_packed_mm: a must be a 2-D int8 CPU tensor, got ", a.sizes(), " ",
              a.scalar_type());
  const int64_t K = a.size(1), groups = (K + kGroup - 1) / kGroup;
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(1) == groups && packed.size(2) == kPanelCols &&
                  packed.size(3) == kGroup,
              "int8_packed_mm: packed must come from this build's pack_int8_weight for ", K,
              " input features, got ", packed.sizes());
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kPanelCols &&
                  out_features <= packed.size(0) * kPanelCols,
              "int8_packed_mm: out_features ", out_features, " does not match ", packed.size(0),
              " panels");
  const at::Tensor rows = int8_rows_padded(a);
  at::Tensor out = at::empty({a.size(0), out_features}, a.options().dtype(at::kInt));
  if (a.size(0) > 0) {
    int8_packed_mm_into(rows.const_data_ptr<int8_t>(), a.size(0), groups * kGroup,
                        packed.const_data_ptr<int8_t>(), out_features, 0, out_features,
                        out.mutable_data_ptr<int32_t>(), out_features);
  }
  return out;
}

void check_float_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), op,
              ": x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
}

// x [M, K] float32 through an int8 linear: each row quantized as quantize_rows does, its exact
// int32 sums with the weight packed by pack_int8_weight, and per panel column c
// y = sum * row scale * col_scale[c] + col_bias[c]. Plain: out column p * int8_panel_cols() + c
// is y of panel p's column c. swiglu: panel p holds gate columns in its first half and the
// matching up columns in its second, and out column p * half + c is silu_times(gate, up) of its
// columns c and half + c. col_scale, col_bias (float32) and col_sums (the int8 weight rows' sums,
// int32) are laid out as the panels' columns: [panels * int8_panel_cols()].
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& col_scale,
                       const at::Tensor& col_sums, const at::Tensor& col_bias,
                       int64_t out_features, bool swiglu) {
  check_float_rows(x, "int8_linear");
  constexpr int64_t kValues = lane_values(kLinearLanes);
  constexpr auto kLaneType = kLinearLanes == Lanes4::kWide ? at::kShort : at::kChar;
  const int64_t M = x.size(0), K = x.size(1), groups = (K + kValues - 1) / kValues;
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == kLaneType && packed.is_contiguous() &&
                  packed.size(1) == groups && packed.size(2) == kPanelCols &&
                  packed.size(3) == kValues,
              "int8_linear: packed must come from this build's pack_int8_linear for ", K,
              " input features, got ", packed.sizes());
  const int64_t panels = packed.size(0), columns = panels * kPanelCols;
  for (const at::Tensor* t : {&col_scale, &col_sums, &col_bias}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == columns && t->is_contiguous() &&
                    t->device().is_cpu(),
                "int8_linear: col_scale, col_sums and col_bias must be contiguous [", columns,
                "], got ", t->sizes());
  }
  TORCH_CHECK(col_scale.scalar_type() == at::kFloat && col_bias.scalar_type() == at::kFloat &&
                  col_sums.scalar_type() == at::kInt,
              "int8_linear: col_scale and col_bias must be float32, col_sums int32");
  const int64_t cols_per_panel = swiglu ? kVecCols : kPanelCols;
  TORCH_CHECK(out_features > (panels - 1) * cols_per_panel &&
                  out_features <= panels * cols_per_panel,
              "int8_linear: out_features ", out_features, " does not match ", panels,
              swiglu ? " SwiGLU panels" : " panels");
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty({M, out_features}, input.options());
  if (M == 0) return out;
  const int64_t k_padded = groups * kValues;
  at::Tensor q = at::empty({M, k_padded}, input.options().dtype(kLaneType));
  at::Tensor row_scale = at::empty({M}, input.options());
  quantize_rows<kLinearLanes>(input.const_data_ptr<float>(), M, K, k_padded,
                              static_cast<LaneValue<kLinearLanes>*>(q.mutable_data_ptr()),
                              row_scale.mutable_data_ptr<float>());
  const float* rs = row_scale.const_data_ptr<float>();
  const float* cs = col_scale.const_data_ptr<float>();
  const float* cb = col_bias.const_data_ptr<float>();
  const int32_t* sums = col_sums.const_data_ptr<int32_t>();
  float* op = out.mutable_data_ptr<float>();
  walk_panels<kLinearLanes>(
      static_cast<const int8_t*>(q.const_data_ptr()), M, k_padded * q.element_size(),
      static_cast<const int8_t*>(packed.const_data_ptr()), 0, panels,
      [&](const int32_t* tile, int64_t rows, int64_t m, int64_t p) {
        const DenormalsFlushed flushed(swiglu);
        const int64_t c0 = p * kPanelCols;
        const int64_t cols = std::min(cols_per_panel, out_features - p * cols_per_panel);
        for (int64_t r = 0; r < rows; ++r) {
          const int32_t* t = tile + r * kPanelCols;
          alignas(64) float y[kPanelCols];
#pragma omp simd
          for (int64_t c = 0; c < kPanelCols; ++c) {
            // NOTE: unsigned, so that a wrapped offset sum comes back exact (vpdpbusd wraps too).
            const uint32_t offset =
                kLinearLanes == Lanes4::kOffset ? uint32_t{kRowOffset} * sums[c0 + c] : 0u;
            const auto sum = static_cast<int32_t>(static_cast<uint32_t>(t[c]) - offset);
            y[c] = scaled_sum(sum, rs[m + r], cs[c0 + c], cb[c0 + c]);
          }
          float* row = op + (m + r) * out_features + p * cols_per_panel;
          if (swiglu) {
#pragma omp simd
            for (int64_t c = 0; c < cols; ++c) row[c] = silu_times(y[c], y[kVecCols + c]);
          } else {
            std::copy(y, y + cols, row);
          }
        }
      });
  return out;
}

// x [M, K] float32 -> (q [M, K] int8, scales [M] float32), each row as int8_linear quantizes
// it (symmetric, by its largest magnitude): the input of torch._int_mm.
std::tuple<at::Tensor, at::Tensor> int8_quantize_rows(const at::Tensor& x) {
  check_float_rows(x, "int8_quantize_rows");
  const at::Tensor input = x.contiguous();
  const int64_t M = input.size(0), K = input.size(1);
  at::Tensor q = at::empty({M, K}, input.options().dtype(at::kChar));
  at::Tensor scales = at::empty({M}, input.options());
  quantize_rows<Lanes4::kSigned>(input.const_data_ptr<float>(), M, K, K,
                                q.mutable_data_ptr<int8_t>(), scales.mutable_data_ptr<float>());
  return {q, scales};
}

// sums [M, N] int32 (an int8 GEMM's) -> float32: scaled_sum of each, and with swiglu (N = 2I,
// gate columns then up columns) silu_times(gate, up) [M, I], as int8_linear gives them.
at::Tensor int8_scale_sums(const at::Tensor& sums, const at::Tensor& row_scale,
                           const at::Tensor& col_scale, const at::Tensor& col_bias,
                           bool swiglu) {
  TORCH_CHECK(sums.dim() == 2 && sums.scalar_type() == at::kInt && sums.device().is_cpu(),
              "int8_scale_sums: sums must be a 2-D int32 CPU tensor, got ", sums.sizes());
  const int64_t M = sums.size(0), N = sums.size(1);
  TORCH_CHECK(row_scale.dim() == 1 && row_scale.size(0) == M &&
                  row_scale.scalar_type() == at::kFloat,
              "int8_scale_sums: row_scale must be float32 [", M, "]");
  for (const at::Tensor* t : {&col_scale, &col_bias}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == N && t->scalar_type() == at::kFloat,
                "int8_scale_sums: col_scale and col_bias must be float32 [", N, "]");
  }
  TORCH_CHECK(!swiglu || N % 2 == 0, "int8_scale_sums: a SwiGLU needs an even column count");
  const at::Tensor s = sums.contiguous(), rs_t = row_scale.contiguous();
  const at::Tensor cs_t = col_scale.contiguous(), cb_t = col_bias.contiguous();
  const int64_t width = swiglu ? N / 2 : N;
  at::Tensor out = at::empty({M, width}, rs_t.options());
  const int32_t* sp = s.const_data_ptr<int32_t>();
  const float* rs = rs_t.const_data_ptr<float>();
  const float* cs = cs_t.const_data_ptr<float>();
  const float* cb = cb_t.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1)),
                   [&](int64_t begin, int64_t end) {
    const DenormalsFlushed flushed(swiglu);
    for (int64_t m = begin; m < end; ++m) {
      const int32_t* row = sp + m * N;
      float* dst = op + m * width;
      if (swiglu) {
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) {
          dst[c] = silu_times(scaled_sum(row[c], rs[m], cs[c], cb[c]),
                              scaled_sum(row[width + c], rs[m], cs[width + c], cb[width + c]));
        }
      } else {
#pragma omp simd
        for (int64_t c = 0; c < N; ++c) dst[c] = scaled_sum(row[c], rs[m], cs[c], cb[c]);
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace vbatch

TORCH_LIBRARY_FRAGMENT(vbatch, m) {
  m.def("int8_panel_cols() -> int", &vbatch::int8_panel_cols);
  m.def("pack_int8_weight(Tensor weight) -> Tensor");
  m.def("pack_int8_linear(Tensor weight) -> Tensor");
  m.def("int8_linear_lane_values() -> int", &vbatch::int8_linear_lane_values);
  m.def("int8_packed_mm(Tensor a, Tensor packed, int out_features) -> Tensor");
  m.def(
      "int8_linear(Tensor x, Tensor packed, Tensor col_scale, Tensor col_sums, Tensor col_bias, "
      "int out_features, bool swiglu) -> Tensor");
  m.def("int8_quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def(
      "int8_scale_sums(Tensor sums, Tensor row_scale, Tensor col_scale, Tensor col_bias, "
      "bool swiglu) -> Tensor");
}

TORCH_LIBRARY_IMPL(vbatch, CPU, m) {
  m.impl("pack_int8_weight", &vbatch::pack_int8_weight);
  m.impl("pack_int8_linear", &vbatch::pack_int8_linear);
  m.impl("int8_packed_mm", &vbatch::int8_packed_mm);
  m.impl("int8_linear", &vbatch::int8_linear);
  m.impl("int8_quantize_rows", &vbatch::int8_quantize_rows);
  m.impl("int8_scale_sums", &vbatch::int8_scale_sums);
}
