// CPU kernel of the int8 greedy screen: which vocab entries could hold a row's fp32 argmax.
//
// Per vocab chunk, one int8 GEMM (at::_int_mm where it is exact, else vbatch's own over the head
// packed by pack_int8_weight, int8_gemm.cpp) gives both quantization levels of every hidden row
// against the int8 LM head; one pass over that int32 tile turns it into an
// approximate logit a and a rigorous error bound eps per entry. A row keeps a running lower
// bound L on its best logit (the largest a - eps seen) and collects, in vocab order, the entries
// with a + eps >= L: any entry left out is below some other entry for certain. The caller scores
// the few candidates in fp32.
#include <ATen/Parallel.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "int8_gemm.h"

namespace vbatch {
namespace {

constexpr int64_t kOverflow = -1;

struct RowState {
  float lower_bound = -std::numeric_limits<float>::infinity();
  int64_t count = 0;  // kOverflow once more candidates than fit survived a compaction
};

// Drop the candidates that the row's current lower bound rules out, keeping vocab order.
int64_t compact(int64_t* ids, float* upper, int64_t count, float lower_bound) {
  int64_t kept = 0;
  for (int64_t k = 0; k < count; ++k) {
    if (upper[k] >= lower_bound) {
      ids[kept] = ids[k];
      upper[kept] = upper[k];
      ++kept;
    }
  }
  return kept;
}

void screen_chunk_row(const int32_t* dot_hi, const int32_t* dot_lo, float scale_hi,
                      float scale_lo, float hidden_coef, float residual_coef,
                      const float* weight_scales, const float* residual_norms,
                      const float* weight_norms, int64_t chunk_start, int64_t chunk_len,
                      int64_t max_candidates, RowState& state, int64_t* ids, float* upper,
                      float* chunk_upper) {
  if (state.count == kOverflow) {
    return;
  }
  // NOTE: eps = hidden_coef * |r_v| + residual_coef * |W_v|; see greedy_screen.py.
  float best = state.lower_bound;
#pragma omp simd reduction(max : best)
  for (int64_t j = 0; j < chunk_len; ++j) {
    const float approx = weight_scales[j] * (scale_hi * static_cast<float>(dot_hi[j]) +
                                             scale_lo * static_cast<float>(dot_lo[j]));
    const float eps = hidden_coef * residual_norms[j] + residual_coef * weight_norms[j];
    chunk_upper[j] = approx + eps;
    best = std::max(best, approx - eps);
  }
  state.lower_bound = best;
  // Keeps entry j unless its upper bound is below `best` (a NaN one is kept); false once the
  // row has overflowed.
  const auto take = [&](int64_t j) {
    if (state.count == max_candidates) {
      state.count = compact(ids, upper, state.count, best);
      if (state.count == max_candidates) {
        state.count = kOverflow;
        return false;
      }
    }
    ids[state.count] = chunk_start + j;
    upper[state.count] = chunk_upper[j];
    ++state.count;
    return true;
  };
  int64_t j = 0;
#if defined(__AVX512F__)
  // NOTE: a handful of the chunk's entries survive, so 16 comparisons to one mask replace 16
  // branches; the scalar scan cost as much as the int8 GEMM and moved by ~30% with code layout.
  const __m512 best_lanes = _mm512_set1_ps(best);
  for (; j + 16 <= chunk_len; j += 16) {
    __mmask16 kept = _mm512_cmp_ps_mask(_mm512_loadu_ps(chunk_upper + j), best_lanes, _CMP_NLT_UQ);
    while (kept != 0) {
      if (!take(j + __builtin_ctz(kept))) {
        return;
      }
      kept &= kept - 1;
    }
  }
#endif
  for (; j < chunk_len; ++j) {
    if (!(chunk_upper[j] < best) && !take(j)) {
      return;
    }
  }
}

// q_hidden [2 * num_rows, hidden] int8: rows 0..n-1 the first level, n..2n-1 the second.
// row_params [num_rows, 4] float32: scale_hi, scale_lo, hidden_coef, residual_coef.
// packed_weight: pack_int8_weight(q_weight), whose GEMM replaces at::_int_mm, or none.
// Returns candidates [num_rows, max_candidates] int64 (-1 padded, vocab order) and per-row
// counts (int64; -1 when a row had too many candidates and must be scored in full).
std::tuple<at::Tensor, at::Tensor> int8_greedy_screen_cpu(
    const at::Tensor& q_hidden, const at::Tensor& q_weight, const at::Tensor& row_params,
    const at::Tensor& weight_scales, const at::Tensor& residual_norms,
    const at::Tensor& weight_norms, int64_t chunk_size, int64_t max_candidates,
    const std::optional<at::Tensor>& packed_weight) {
  TORCH_CHECK(q_hidden.dim() == 2 && q_hidden.scalar_type() == at::kChar &&
                  q_hidden.size(0) % 2 == 0,
              "int8_greedy_screen: q_hidden must be [2 * num_rows, hidden] int8");
  TORCH_CHECK(q_weight.dim() == 2 && q_weight.scalar_type() == at::kChar &&
                  q_weight.size(1) == q_hidden.size(1) && q_weight.is_contiguous(),
              "int8_greedy_screen: q_weight must be a contiguous [vocab, hidden] int8");
  const int64_t num_rows = q_hidden.size(0) / 2, vocab = q_weight.size(0);
  TORCH_CHECK(row_params.dim() == 2 && row_params.size(0) == num_rows &&
                  row_params.size(1) == 4 && row_params.scalar_type() == at::kFloat &&
                  row_params.is_contiguous(),
              "int8_greedy_screen: row_params must be a contiguous [num_rows, 4] float32");
  for (const at::Tensor* t : {&weight_scales, &residual_norms, &weight_norms}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == vocab && t->scalar_type() == at::kFloat &&
                    t->is_contiguous(),
                "int8_greedy_screen: per-vocab tensors must be contiguous [vocab] float32");
  }
  TORCH_CHECK(chunk_size > 0 && max_candidates > 0,
              "int8_greedy_screen: chunk_size and max_candidates must be positive");
  const bool packed = packed_weight.has_value() && packed_weight->defined();
  const int64_t hidden = q_hidden.size(1), k_padded = (hidden + 3) / 4 * 4;
  if (packed) {
    TORCH_CHECK(packed_weight->dim() == 4 && packed_weight->scalar_type() == at::kChar &&
                    packed_weight->is_contiguous() && packed_weight->size(1) * 4 == k_padded &&
                    packed_weight->size(2) == int8_panel_cols() &&
                    packed_weight->size(0) * int8_panel_cols() >= vocab &&
                    chunk_size % int8_panel_cols() == 0,
                "int8_greedy_screen: packed_weight must be this build's pack_int8_weight of "
                "q_weight, and chunk_size a multiple of its ", int8_panel_cols(), " columns");
  }
  const at::Tensor q_hidden_c = packed ? int8_rows_padded(q_hidden) : q_hidden.contiguous();
  at::Tensor candidates =
      at::full({num_rows, max_candidates}, -1, q_hidden.options().dtype(at::kLong));
  std::vector<float> upper(num_rows * max_candidates);
  std::vector<RowState> states(num_rows);
  const float* params = row_params.const_data_ptr<float>();
  const float* scales = weight_scales.const_data_ptr<float>();
  const float* residuals = residual_norms.const_data_ptr<float>();
  const float* norms = weight_norms.const_data_ptr<float>();
  int64_t* ids = candidates.mutable_data_ptr<int64_t>();
  for (int64_t start = 0; start < vocab; start += chunk_size) {
    const int64_t len = std::min(chunk_size, vocab - start);
    // [2 * num_rows, len] int32
    at::Tensor dots;
    if (packed) {
      dots = at::empty({2 * num_rows, len}, q_hidden.options().dtype(at::kInt));
      int8_packed_mm_into(q_hidden_c.const_data_ptr<int8_t>(), 2 * num_rows, k_padded,
                          packed_weight->const_data_ptr<int8_t>(), vocab, start, start + len,
                          dots.mutable_data_ptr<int32_t>(), len);
    } else {
      dots = at::_int_mm(q_hidden_c, q_weight.narrow(0, start, len).t());
    }
    const int32_t* dot_data = dots.const_data_ptr<int32_t>();
    at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> chunk_upper(len);
      for (int64_t r = begin; r < end; ++r) {
        const float* p = params + 4 * r;
        screen_chunk_row(dot_data + r * len, dot_data + (num_rows + r) * len, p[0], p[1], p[2],
                         p[3], scales + start, residuals + start, norms + start, start, len,
                         max_candidates, states[r], ids + r * max_candidates,
                         upper.data() + r * max_candidates, chunk_upper.data());
      }
    });
  }
  at::Tensor counts = at::empty({num_rows}, q_hidden.options().dtype(at::kLong));
  int64_t* count_data = counts.mutable_data_ptr<int64_t>();
  for (int64_t r = 0; r < num_rows; ++r) {
    RowState& state = states[r];
    int64_t* row_ids = ids + r * max_candidates;
    if (state.count != kOverflow) {
      state.count = compact(row_ids, upper.data() + r * max_candidates, state.count,
                            state.lower_bound);
    }
    std::fill(row_ids + std::max<int64_t>(state.count, 0), row_ids + max_candidates, -1);
    count_data[r] = state.count;
  }
  return {candidates, counts};
}

// The smallest float32 not below the non-negative `x`.
inline float round_up_to_float(double x) {
  const float down = static_cast<float>(x);
  return static_cast<double>(down) < x ? std::nextafter(down, std::numeric_limits<float>::infinity())
                                       : down;
}

// weight [vocab, hidden] float32 -> the screen's int8 head in one pass over it: q [vocab,
// hidden] int8 with w ~ scale * q (scale = max|w| / 127 per row, q = w / scale rounded to
// nearest even, as torch.round), and per row float32 scales, |w - scale * q| and |w| (2-norms
// summed in float64, where w - scale * q is exact, then rounded up to float32).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> int8_quantize_head_cpu(
    const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "int8_quantize_head: weight must be a contiguous [vocab, hidden] float32");
  const int64_t vocab = weight.size(0), hidden = weight.size(1);
  at::Tensor q = at::empty({vocab, hidden}, weight.options().dtype(at::kChar));
  at::Tensor scales = at::empty({vocab}, weight.options());
  at::Tensor residual_norms = at::empty({vocab}, weight.options());
  at::Tensor weight_norms = at::empty({vocab}, weight.options());
  const float* w = weight.const_data_ptr<float>();
  int8_t* q_data = q.mutable_data_ptr<int8_t>();
  float* scale_data = scales.mutable_data_ptr<float>();
  float* residual_data = residual_norms.mutable_data_ptr<float>();
  float* norm_data = weight_norms.mutable_data_ptr<float>();
  at::parallel_for(0, vocab, 256, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      const float* row = w + v * hidden;
      float max_abs = 0.0f;
      for (int64_t d = 0; d < hidden; ++d) max_abs = std::max(max_abs, std::fabs(row[d]));
      const float scale = std::max(max_abs / 127.0f, std::numeric_limits<float>::min());
      double residual_sq = 0.0, norm_sq = 0.0;
      for (int64_t d = 0; d < hidden; ++d) {
        const float value = std::clamp(std::nearbyint(row[d] / scale), -127.0f, 127.0f);
        q_data[v * hidden + d] = static_cast<int8_t>(value);
        const double residual =
            static_cast<double>(row[d]) - static_cast<double>(scale) * static_cast<double>(value);
        residual_sq += residual * residual;
        norm_sq += static_cast<double>(row[d]) * static_cast<double>(row[d]);
      }
      scale_data[v] = scale;
      residual_data[v] = round_up_to_float(std::sqrt(residual_sq));
      norm_data[v] = round_up_to_float(std::sqrt(norm_sq));
    }
  });
  return {q, scales, residual_norms, weight_norms};
}

}  // namespace
}  // namespace vbatch

TORCH_LIBRARY_FRAGMENT(vbatch, m) {
  m.def(
      "int8_greedy_screen(Tensor q_hidden, Tensor q_weight, Tensor row_params, "
      "Tensor weight_scales, Tensor residual_norms, Tensor weight_norms, int chunk_size, "
      "int max_candidates, Tensor? packed_weight=None) -> (Tensor, Tensor)");
  m.def("int8_quantize_head(Tensor weight) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vbatch, CPU, m) {
  m.impl("int8_greedy_screen", &vbatch::int8_greedy_screen_cpu);
  m.impl("int8_quantize_head", &vbatch::int8_quantize_head_cpu);
}
