// CPU kernel of the prompt-logprob head: a row-wise logsumexp over the vocab, one tile of
// logits at a time, so the LM head runs in vocab chunks for all of a step's rows and no
// [rows, vocab] logits tensor is ever written out.
//
// Each row keeps a running maximum m and sum s of exp(logit - m) (in double); a tile moves m to
// the larger of the two maxima and rescales s once. The tile's row is read twice (max, then
// exp-sum) while it sits in L1/L2. The logit of each row's target token is taken from the tile
// that holds it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "../vec_math.h"

namespace vbatch {
namespace {

// NOTE: float partial sums of this many terms before they go into the row's double sum.
constexpr int64_t kSumBlock = 1024;
constexpr int64_t kElementsPerTask = 1 << 16;

void logsumexp_update_cpu(const at::Tensor& tile, const at::Tensor& targets, int64_t vocab_start,
                          at::Tensor& row_max, at::Tensor& row_sum, at::Tensor& target_logits) {
  TORCH_CHECK(tile.dim() == 2 && tile.scalar_type() == at::kFloat && tile.stride(1) == 1,
              "logsumexp_update: tile must be float32 [rows, chunk] with contiguous rows");
  const int64_t num_rows = tile.size(0), chunk = tile.size(1);
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == num_rows &&
                  targets.scalar_type() == at::kLong && targets.is_contiguous(),
              "logsumexp_update: targets must be a contiguous int64 [rows]");
  TORCH_CHECK(row_max.scalar_type() == at::kFloat && row_max.is_contiguous() &&
                  row_max.numel() == num_rows,
              "logsumexp_update: row_max must be a contiguous float32 [rows]");
  TORCH_CHECK(row_sum.scalar_type() == at::kDouble && row_sum.is_contiguous() &&
                  row_sum.numel() == num_rows,
              "logsumexp_update: row_sum must be a contiguous float64 [rows]");
  TORCH_CHECK(target_logits.scalar_type() == at::kFloat && target_logits.is_contiguous() &&
                  target_logits.numel() == num_rows,
              "logsumexp_update: target_logits must be a contiguous float32 [rows]");
  const float* data = tile.const_data_ptr<float>();
  const int64_t stride = tile.stride(0);
  const int64_t* target = targets.const_data_ptr<int64_t>();
  float* maxima = row_max.mutable_data_ptr<float>();
  double* sums = row_sum.mutable_data_ptr<double>();
  float* picked = target_logits.mutable_data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(chunk, 1));
  at::parallel_for(0, num_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = data + r * stride;
      float tile_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : tile_max)
      for (int64_t j = 0; j < chunk; ++j) tile_max = std::max(tile_max, row[j]);
      const int64_t t = target[r] - vocab_start;
      if (t >= 0 && t < chunk) picked[r] = row[t];
      const float new_max = std::max(maxima[r], tile_max);
      if (new_max == -std::numeric_limits<float>::infinity()) continue;
      double sum = sums[r] == 0.0 ? 0.0 : sums[r] * std::exp(double(maxima[r]) - new_max);
      for (int64_t start = 0; start < chunk; start += kSumBlock) {
        const int64_t stop = std::min(chunk, start + kSumBlock);
        float part = 0.0f;
#pragma omp simd reduction(+ : part)
        for (int64_t j = start; j < stop; ++j) part += fast_exp(row[j] - new_max);
        sum += part;
      }
      maxima[r] = new_max;
      sums[r] = sum;
    }
  });
}

}  // namespace
}  // namespace vbatch

TORCH_LIBRARY_FRAGMENT(vbatch, m) {
  m.def(
      "logsumexp_update(Tensor tile, Tensor targets, int vocab_start, Tensor(a!) row_max, "
      "Tensor(b!) row_sum, Tensor(c!) target_logits) -> ()");
}

TORCH_LIBRARY_IMPL(vbatch, CPU, m) { m.impl("logsumexp_update", &vbatch::logsumexp_update_cpu); }
