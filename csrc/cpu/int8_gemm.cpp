// Exact int8 x int8 -> int32 GEMM for CPUs whose library int8 GEMMs are inexact or slow.
//
// Without VNNI, torch's `_int_mm` (oneDNN) and FBGEMM multiply u8 x s8 bytes with vpmaddubsw,
// which adds each pair of products in saturating int16: full-range values overflow it and the
// sums come out wrong. Here each signed activation byte a is split into |a| (the unsigned
// operand) and its sign, moved onto the weight byte (vpsignb under AVX2, a masked negation under
// AVX-512), so every product is |a| * (+-w) with |a| <= 128 and |w| <= 127: a pair sums to at
// most 2 * 128 * 127 = 32512, inside int16, and the int32 sums are exact. The weight must stay
// off -128, whose negation overflows (pack_int8_weight checks); any activation byte is fine.
// With AVX512-VNNI one
// vpdpbusd adds the four products of a lane straight into int32.
//
// A weight [N, K] is packed once into panels of int8_panel_cols() output columns as
// [panels, K / 4, cols, 4]: one vector load gives a vector's columns four k values each, and an
// activation row's four bytes at that k are broadcast to every column (the VNNI layout). Each
// micro-kernel call keeps R rows x 2 vectors of int32 accumulators in registers.
#include "int8_gemm.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#if defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace vbatch {
namespace {

constexpr int64_t kGroup = 4;  // k values per column in one vector lane

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

constexpr int64_t kPanelCols = 2 * kVecCols;
constexpr int64_t kPanelGroupBytes = kPanelCols * kGroup;
// NOTE: the activation rows one pass over a thread's panels serves stay in L2 beside the panel.
constexpr int64_t kRowBlockBytes = 256 * 1024;

inline int32_t load4(const int8_t* p) {
  int32_t bytes;
  std::memcpy(&bytes, p, sizeof(bytes));
  return bytes;
}

// out[r, c] = sum_k a[r, k] * panel column c, for r < R and c < cols.
template <int R>
void micro_kernel(const int8_t* a, int64_t lda, const int8_t* panel, int64_t groups,
                  int32_t* out, int64_t ldo, int64_t cols) {
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
      const IVec magnitudes = ivec_abs8(x);
      const Signs signs = signs_of(x);
      acc0[r] = dot4(acc0[r], magnitudes, with_signs(w0, signs));
      acc1[r] = dot4(acc1[r], magnitudes, with_signs(w1, signs));
    }
  }
  alignas(64) int32_t tile[kPanelCols];
  for (int r = 0; r < R; ++r) {
    int32_t* row = out + r * ldo;
    if (cols == kPanelCols) {
      ivec_store(row, acc0[r]);
      ivec_store(row + kVecCols, acc1[r]);
    } else {
      ivec_store(tile, acc0[r]);
      ivec_store(tile + kVecCols, acc1[r]);
      std::copy(tile, tile + cols, row);
    }
  }
#else
  for (int r = 0; r < R; ++r) {
    int32_t sums[kPanelCols] = {};
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* x = a + r * lda + g * kGroup;
      const int8_t* w = panel + g * kPanelGroupBytes;
      for (int64_t c = 0; c < kPanelCols; ++c) {
        for (int64_t j = 0; j < kGroup; ++j) sums[c] += int32_t{x[j]} * int32_t{w[c * kGroup + j]};
      }
    }
    std::copy(sums, sums + cols, out + r * ldo);
  }
#endif
}

template <int R>
void rows_tail(const int8_t* a, int64_t lda, const int8_t* panel, int64_t groups, int32_t* out,
               int64_t ldo, int64_t cols, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) {
      rows_tail<R - 1>(a, lda, panel, groups, out, ldo, cols, rows);
      return;
    }
  }
  micro_kernel<R>(a, lda, panel, groups, out, ldo, cols);
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
  const int64_t groups = k_padded / kGroup;
  const int64_t panel_bytes = groups * kPanelGroupBytes;
  const int64_t last_col = std::min(col_end, N);
  const int64_t first_panel = col_begin / kPanelCols;
  const int64_t end_panel = (last_col + kPanelCols - 1) / kPanelCols;
  const int64_t block_rows =
      std::max<int64_t>(kRowBlock, kRowBlockBytes / std::max<int64_t>(k_padded, 1) / kRowBlock *
                                       kRowBlock);
  at::parallel_for(first_panel, end_panel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
      const int64_t m_end = std::min(M, m0 + block_rows);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t c0 = p * kPanelCols;
        const int64_t cols = std::min(kPanelCols, last_col - c0);
        for (int64_t m = m0; m < m_end; m += kRowBlock) {
          rows_tail<kRowBlock>(a + m * k_padded, k_padded, packed + p * panel_bytes, groups,
                               out + m * ldo + (c0 - col_begin), ldo, cols,
                               std::min<int64_t>(kRowBlock, m_end - m));
        }
      }
    }
  });
}

namespace {

// weight [N, K] int8 -> [panels, ceil(K / 4), int8_panel_cols(), 4], zeros past N and K.
at::Tensor pack_int8_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.device().is_cpu(),
              "pack_int8_weight: weight must be a 2-D int8 CPU tensor, got ", weight.sizes(), " ",
              weight.scalar_type());
  TORCH_CHECK(weight.numel() == 0 || weight.min().item<int8_t>() >= -127,
              "pack_int8_weight: weight must hold values in [-127, 127] (-128's negation "
              "overflows)");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t groups = (K + kGroup - 1) / kGroup, panels = (N + kPanelCols - 1) / kPanelCols;
  at::Tensor packed = at::zeros({panels, groups, kPanelCols, kGroup}, w.options());
  const int8_t* src = w.const_data_ptr<int8_t>();
  int8_t* dst = packed.mutable_data_ptr<int8_t>();
  const int64_t full_groups = K / kGroup;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < kPanelCols && p * kPanelCols + c < N; ++c) {
        const int8_t* row = src + (p * kPanelCols + c) * K;
        int8_t* column = dst + (p * groups * kPanelCols + c) * kGroup;
        for (int64_t g = 0; g < full_groups; ++g) {
          std::memcpy(column + g * kPanelGroupBytes, row + g * kGroup, kGroup);
        }
        for (int64_t k = full_groups * kGroup; k < K; ++k) {
          column[full_groups * kPanelGroupBytes + k % kGroup] = row[k];
        }
      }
    }
  });
  return packed;
}

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

}  // namespace
}  // namespace vbatch

TORCH_LIBRARY_FRAGMENT(vbatch, m) {
  m.def("int8_panel_cols() -> int", &vbatch::int8_panel_cols);
  m.def("pack_int8_weight(Tensor weight) -> Tensor");
  m.def("int8_packed_mm(Tensor a, Tensor packed, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(vbatch, CPU, m) {
  m.impl("pack_int8_weight", &vbatch::pack_int8_weight);
  m.impl("int8_packed_mm", &vbatch::int8_packed_mm);
}
