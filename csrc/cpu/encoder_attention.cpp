// CPU kernel of an encoder's attention: bidirectional, over a packed batch of whole prompts
// (no padding, no KV cache), every prompt and head at once in one call.
//
// One task is one (prompt, head). Its keys are copied transposed into a [head_dim, n] buffer
// padded to whole SIMD vectors, so a tile of kQueryTile queries scores kNumLanes keys per FMA
// with each key vector loaded once for the tile; the softmax runs on the lanes in float32 and
// the values are summed row by row into each query's output. A prompt of a few dozen tokens is
// a few microseconds of work, far less than a framework attention call costs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "../vec_math.h"

namespace vbatch {
namespace {

constexpr int64_t kQueryTile = 8;
// NOTE: value sums take SIMD chunks of head_dim this many at a time, for two query rows, so
// 2 * kValueChunks accumulators hide the FMA latency and each value vector serves both rows.
constexpr int kValueChunks = 4;

struct TaskView {
  const float* q;
  const float* k;
  const float* v;
  float* out;
  int64_t q_stride;  // between consecutive tokens; out's is num_heads * head_dim
  int64_t k_stride;
  int64_t v_stride;
  int64_t out_stride;
  int64_t n;
  int64_t head_dim;
  float scale;
};

// Scores of queries [first, first + rows) (rows <= kQueryTile) against every key, scaled, into
// scores[r * padded + j]; lanes past n get -inf.
void tile_scores(const TaskView& t, const float* keys_t, int64_t padded, int64_t first,
                 int64_t rows, float* scores) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // NOTE: [d][r]: the tile's kQueryTile values of one dimension share a cache line.
  alignas(64) float q_scaled[512 * kQueryTile];
  for (int64_t d = 0; d < t.head_dim; ++d) {
    for (int64_t r = 0; r < kQueryTile; ++r) {
      q_scaled[d * kQueryTile + r] = r < rows ? t.q[(first + r) * t.q_stride + d] * t.scale : 0.0f;
    }
  }
  for (int64_t j = 0; j < padded; j += kNumLanes) {
    Lanes acc[kQueryTile];
    for (int64_t r = 0; r < kQueryTile; ++r) acc[r] = lanes_zero();
    for (int64_t d = 0; d < t.head_dim; ++d) {
      const Lanes key = lanes_load(keys_t + d * padded + j);
      const float* q_d = q_scaled + d * kQueryTile;
      for (int64_t r = 0; r < kQueryTile; ++r) acc[r] = lanes_fmadd(lanes_set1(q_d[r]), key, acc[r]);
    }
    for (int64_t r = 0; r < rows; ++r) {
      Lanes s = acc[r];
      if (j + kNumLanes > t.n) s = lanes_fill_from(s, t.n - j, neg_inf);
      lanes_store(scores + r * padded + j, s);
    }
  }
}

// Turns one row of scores into probabilities in place and returns 1 / their sum.
float softmax_row(float* row, int64_t padded) {
  Lanes best = lanes_set1(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < padded; j += kNumLanes) best = lanes_max(best, lanes_load(row + j));
  alignas(64) float lanes[kNumLanes];
  lanes_store(lanes, best);
  const float row_max = *std::max_element(lanes, lanes + kNumLanes);
  Lanes sum = lanes_zero();
  const Lanes shift = lanes_set1(row_max);
  for (int64_t j = 0; j < padded; j += kNumLanes) {
    const Lanes p = lanes_exp(lanes_sub(lanes_load(row + j), shift));
    lanes_store(row + j, p);
    sum = lanes_add(sum, p);
  }
  lanes_store(lanes, sum);
  float total = 0.0f;
  for (const float x : lanes) total += x;
  return 1.0f / total;
}

// out0[c] = sum_j p0[j] * values[j * stride + c] for c < NC * kNumLanes; out1 likewise with p1.
template <int NC>
void weighted_sum_pair(const float* p0, const float* p1, const float* values, int64_t n,
                       int64_t stride, float* out0, float* out1) {
  Lanes acc0[NC], acc1[NC];
  for (int c = 0; c < NC; ++c) acc0[c] = acc1[c] = lanes_zero();
  for (int64_t j = 0; j < n; ++j) {
    const Lanes w0 = lanes_set1(p0[j]), w1 = lanes_set1(p1[j]);
    const float* row = values + j * stride;
    for (int c = 0; c < NC; ++c) {
      const Lanes x = lanes_load(row + c * kNumLanes);
      acc0[c] = lanes_fmadd(w0, x, acc0[c]);
      acc1[c] = lanes_fmadd(w1, x, acc1[c]);
    }
  }
  for (int c = 0; c < NC; ++c) {
    lanes_store(out0 + c * kNumLanes, acc0[c]);
    lanes_store(out1 + c * kNumLanes, acc1[c]);
  }
}

// The value sums of two probability rows over all of head_dim (a scalar loop past the last
// whole SIMD chunk).
void weighted_sums(const float* p0, const float* p1, const TaskView& t, float* out0,
                   float* out1) {
  int64_t d = 0;
  for (; d + kValueChunks * kNumLanes <= t.head_dim; d += kValueChunks * kNumLanes) {
    weighted_sum_pair<kValueChunks>(p0, p1, t.v + d, t.n, t.v_stride, out0 + d, out1 + d);
  }
  const int64_t chunks = (t.head_dim - d) / kNumLanes;
  if (chunks == 3) weighted_sum_pair<3>(p0, p1, t.v + d, t.n, t.v_stride, out0 + d, out1 + d);
  if (chunks == 2) weighted_sum_pair<2>(p0, p1, t.v + d, t.n, t.v_stride, out0 + d, out1 + d);
  if (chunks == 1) weighted_sum_pair<1>(p0, p1, t.v + d, t.n, t.v_stride, out0 + d, out1 + d);
  for (d += chunks * kNumLanes; d < t.head_dim; ++d) {
    float sum0 = 0.0f, sum1 = 0.0f;
    for (int64_t j = 0; j < t.n; ++j) {
      sum0 += p0[j] * t.v[j * t.v_stride + d];
      sum1 += p1[j] * t.v[j * t.v_stride + d];
    }
    out0[d] = sum0;
    out1[d] = sum1;
  }
}

#if defined(__AVX2__)
// Transposes the 8x8 block at src (rows `src_stride` apart) into dst (rows `dst_stride` apart).
inline void transpose8x8(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#endif

// keys_t[d * padded + j] = key j's d-th value, zero for j in [n, padded). Element by element,
// the scattered stores cost more than all of a short prompt's attention (measured); 8x8 blocks
// in registers do not.
void transpose_keys(const TaskView& t, int64_t padded, float* keys_t) {
  int64_t j0 = 0;
#if defined(__AVX2__)
  const int64_t whole_d = t.head_dim / 8 * 8;
  for (; j0 + 8 <= t.n; j0 += 8) {
    for (int64_t d = 0; d < whole_d; d += 8) {
      transpose8x8(t.k + j0 * t.k_stride + d, t.k_stride, keys_t + d * padded + j0, padded);
    }
    for (int64_t j = j0; j < j0 + 8; ++j) {
      for (int64_t d = whole_d; d < t.head_dim; ++d) keys_t[d * padded + j] = t.k[j * t.k_stride + d];
    }
  }
#endif
  for (int64_t j = j0; j < t.n; ++j) {
    for (int64_t d = 0; d < t.head_dim; ++d) keys_t[d * padded + j] = t.k[j * t.k_stride + d];
  }
  for (int64_t d = 0; d < t.head_dim; ++d) {
    std::fill(keys_t + d * padded + t.n, keys_t + (d + 1) * padded, 0.0f);
  }
}

void attend_task(const TaskView& t, std::vector<float>& keys_t, std::vector<float>& scores,
                 std::vector<float>& sums) {
  const int64_t padded = (t.n + kNumLanes - 1) / kNumLanes * kNumLanes;
  keys_t.resize(t.head_dim * padded);
  transpose_keys(t, padded, keys_t.data());
  scores.resize(kQueryTile * padded);
  sums.resize(2 * t.head_dim);
  float inv_sums[kQueryTile];
  for (int64_t first = 0; first < t.n; first += kQueryTile) {
    const int64_t rows = std::min(kQueryTile, t.n - first);
    tile_scores(t, keys_t.data(), padded, first, rows, scores.data());
    for (int64_t r = 0; r < rows; ++r) inv_sums[r] = softmax_row(scores.data() + r * padded, padded);
    for (int64_t r = 0; r < rows; r += 2) {
      const int64_t r1 = std::min(r + 1, rows - 1);
      weighted_sums(scores.data() + r * padded, scores.data() + r1 * padded, t, sums.data(),
                    sums.data() + t.head_dim);
      for (int64_t i = r; i <= r1; ++i) {
        float* out = t.out + (first + i) * t.out_stride;
        const float* sum = sums.data() + (i - r) * t.head_dim;
#pragma omp simd
        for (int64_t d = 0; d < t.head_dim; ++d) out[d] = sum[d] * inv_sums[i];
      }
    }
  }
}

void check_qkv(const at::Tensor& x, const at::Tensor& q, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.sizes() == q.sizes(), "encoder_attention: ", name,
              " must be [num_tokens, num_heads, head_dim] like q");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "encoder_attention: ", name, " must be float32");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "encoder_attention: ", name,
              " must have contiguous heads");
}

at::Tensor encoder_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& cu_seqlens, double scale) {
  check_qkv(q, q, "q");
  check_qkv(k, q, "k");
  check_qkv(v, q, "v");
  TORCH_CHECK(q.size(2) <= 512, "encoder_attention: head_dim above 512 is not supported");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.scalar_type() == at::kInt &&
                  cu_seqlens.is_contiguous() && cu_seqlens.size(0) >= 1,
              "encoder_attention: cu_seqlens must be a contiguous int32 [num_prompts + 1]");
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int32_t* starts = cu_seqlens.const_data_ptr<int32_t>();
  const int64_t num_prompts = cu_seqlens.size(0) - 1;
  TORCH_CHECK(starts[0] == 0 && starts[num_prompts] == num_tokens,
              "encoder_attention: cu_seqlens must run from 0 to num_tokens");
  for (int64_t s = 0; s < num_prompts; ++s) {
    TORCH_CHECK(starts[s + 1] > starts[s], "encoder_attention: every prompt needs a token");
  }
  at::Tensor out = at::empty({num_tokens, num_heads, head_dim}, q.options());
  at::parallel_for(0, num_prompts * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> keys_t, scores, sums;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_heads, h = task % num_heads;
      const int64_t first = starts[s];
      const int64_t head = h * head_dim;
      const TaskView view{q.const_data_ptr<float>() + first * q.stride(0) + head,
                          k.const_data_ptr<float>() + first * k.stride(0) + head,
                          v.const_data_ptr<float>() + first * v.stride(0) + head,
                          out.mutable_data_ptr<float>() + (first * num_heads + h) * head_dim,
                          q.stride(0),
                          k.stride(0),
                          v.stride(0),
                          num_heads * head_dim,
                          starts[s + 1] - first,
                          head_dim,
                          static_cast<float>(scale)};
      attend_task(view, keys_t, scores, sums);
    }
  });
  return out;
}

}  // namespace
}  // namespace vbatch

TORCH_LIBRARY_FRAGMENT(vbatch, m) {
  m.def(
      "encoder_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(vbatch, CPU, m) { m.impl("encoder_attention", &vbatch::encoder_attention_cpu); }
