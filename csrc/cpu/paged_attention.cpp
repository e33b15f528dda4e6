// CPU kernels for vbatch::paged_attention and vbatch::reshape_and_cache (OpenMP, float32 math).
//
// Attention reads K/V straight from the paged cache through the block table, with an online
// (flash style) softmax kept in float32. Decode rows and short chunks go token by token: each
// token reads its context once, serving all query heads (GQA groups share a KV head). Under
// AVX-512, or AVX2 with FMA, a token reads each chunk of its context (up to 1024 rows) as two
// sequential streams: all K rows (scores into a per-thread buffer), one softmax update, then all
// V rows. Long prefill chunks go by tiles of kNumLanes query tokens (16 under AVX-512), one
// token per SIMD lane, so each key the tile loads serves every token of the tile and the GQA
// group's heads, and keys past the tile's last position are skipped (causal). A float32 model
// may keep a bfloat16 or float16 cache: rows widen to float32 a block at a time, which halves
// the bytes each decode step streams from memory.
//
// Per layer, a sliding window limits each query to its last `window` positions (the decode paths
// start at the window; the tiled path masks per lane), and a soft cap maps every scaled score s to
// cap * tanh(s / cap) before the softmax (Gemma 2).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "../paged_attention.h"
#include "../vec_math.h"

namespace vbatch {
namespace {

// Writes `n` cache values to `dst` as float32.
template <typename cache_t>
inline void widen(const cache_t* values, int64_t n, float* dst) {
  if constexpr (std::is_same_v<cache_t, float>) {
    // NOTE: rows are short (a head, 64-128 floats), and a memmove call per row cost more than
    // the copy.
    int64_t i = 0;
    for (; i + kNumLanes <= n; i += kNumLanes) lanes_store(dst + i, lanes_load(values + i));
    for (; i < n; ++i) dst[i] = values[i];
  } else {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + i));
      if constexpr (std::is_same_v<cache_t, c10::Half>) {
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(bits));
      } else {
        // NOTE: a bfloat16 is the top half of a float32, so widening is a 16-bit shift.
        const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16);
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(wide));
      }
    }
#elif defined(__AVX2__) && defined(__F16C__)
    for (; i + 8 <= n; i += 8) {
      const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(values + i));
      if constexpr (std::is_same_v<cache_t, c10::Half>) {
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(bits));
      } else {
        const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16);
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(wide));
      }
    }
#endif
    for (; i < n; ++i) dst[i] = static_cast<float>(values[i]);
  }
}

// Returns `n` cache values as float32: the values themselves for float caches, else a copy.
template <typename cache_t>
inline const float* as_float(const cache_t* values, int64_t n, float* buf) {
  if constexpr (std::is_same_v<cache_t, float>) {
    return values;
  } else {
    widen(values, n, buf);
    return buf;
  }
}

// Rounds `n` float32 values to the cache dtype (nearest even, as torch's .to() does).
template <typename cache_t>
inline void store_as(const float* values, int64_t n, cache_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<cache_t>(values[i]);
}

// Asks for a cache line early, into L2 rather than L1 (read, low temporal locality: x86's
// prefetcht2). A step's rows are read once, and a step ahead of the kernel is ~200 lines: asked
// into L1 they took L1's few fill buffers and stalled the loads of the step being computed. On
// the AVX-512 EPYC (Zen 4) at 2 threads, 64 sequences x ~240 tokens x 30 layers, medians of 3
// (ms/step, in-order / shuffled blocks): the two-phase kernel 36.7 / 54.6 against 48.0 / 51.2
// with L1 prefetches, the AVX2 per-token kernel (-march=haswell) 45.4 / 44.5 against 56.0 /
// 61.8; in the e2e job's decode steps, attention took 2.94-3.11 s against 3.45-3.78 s.
inline void prefetch_line(const void* line) { __builtin_prefetch(line, 0, 1); }

// Asks for one cache row (all KV heads) early: blocks are scattered, so the hardware
// prefetcher cannot run ahead across a block boundary.
template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t row_size) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);
  for (int64_t d = 0; d < row_size; d += kLine) prefetch_line(row + d);
}

// The sizes and strides every attention kernel reads off q [num_tokens, num_heads, head_dim]
// and a cache [num_blocks, block_size, num_kv_heads, head_dim]: `group` query heads share a KV
// head, and a cache row holds every KV head of one position.
struct AttentionShape {
  int64_t num_heads, head_dim, block_size, num_kv_heads, group;
  int64_t q_token_stride, q_head_stride, row_stride, block_stride;
};

inline AttentionShape attention_shape(const at::Tensor& q, const at::Tensor& k_cache) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t row_stride = num_kv_heads * head_dim;
  return {num_heads,   head_dim,    block_size, num_kv_heads, num_heads / num_kv_heads,
          q.stride(0), q.stride(1), row_stride, block_size * row_stride};
}

// What a layer adds to plain causal attention: `window` > 0 limits each query to the last
// `window` positions up to itself (transformers' sliding_window: key k is seen from query q when
// q - window < k <= q); `softcap` > 0 maps each scaled score s to softcap * tanh(s / softcap).
struct ScoreRule {
  float scale;
  int64_t window;
  float softcap;
};

// The first position a query attends to when its context holds `context_len` positions.
inline int64_t window_start(int64_t context_len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
}

// How many positions query row `token` of sequence `seq` attends to: its sequence's cached
// prefix and its own chunk up to and including itself.
inline int64_t causal_context_len(int64_t token, int64_t seq, const int32_t* query_start_loc,
                                  const int32_t* seq_lens) {
  const int64_t query_len = query_start_loc[seq + 1] - query_start_loc[seq];
  return seq_lens[seq] - query_len + (token - query_start_loc[seq]) + 1;
}

// Attends the query rows `tokens` one at a time; token_seq maps every row to its sequence.
// scalar_t is q's and out's dtype; cache_t is the cache's: the same, or 16-bit under float32.
template <typename scalar_t, typename cache_t>
void per_token_attention_impl(const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const std::vector<int64_t>& tokens,
                              const std::vector<int64_t>& token_seq,
                              const int32_t* query_start_loc, const int32_t* seq_lens,
                              const int32_t* block_tables, int64_t max_num_blocks,
                              const ScoreRule& rule, at::Tensor& out) {
  const int64_t num_tokens = static_cast<int64_t>(tokens.size());
  if (num_tokens == 0) return;
  const auto [num_heads, head_dim, block_size, num_kv_heads, group, q_token_stride,
              q_head_stride, row_stride, block_stride] = attention_shape(q, k_cache);
  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  const cache_t* k_data = k_cache.const_data_ptr<cache_t>();
  const cache_t* v_data = v_cache.const_data_ptr<cache_t>();
  scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
  const float scale = rule.scale;
  const int num_threads = at::get_num_threads();

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> q_buf(num_heads * head_dim), acc(num_heads * head_dim);
    std::vector<float> scores(num_heads * block_size), kv_buf(block_stride);
    std::vector<float> running_max(num_heads), running_sum(num_heads);

    // NOTE: dynamic scheduling because causal prefill items grow with their position.
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tokens; ++i) {
      const int64_t token = tokens[i];
      const int64_t seq = token_seq[token];
      const int64_t context_len = causal_context_len(token, seq, query_start_loc, seq_lens);
      const int32_t* block_table = block_tables + seq * max_num_blocks;

      for (int64_t h = 0; h < num_heads; ++h) {
        const scalar_t* q_row = q_data + token * q_token_stride + h * q_head_stride;
        for (int64_t d = 0; d < head_dim; ++d) {
          q_buf[h * head_dim + d] = static_cast<float>(q_row[d]) * scale;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(running_sum.begin(), running_sum.end(), 0.0f);

      // NOTE: each step takes the rest of one block; only a window's first block starts mid-way.
      for (int64_t start = window_start(context_len, rule.window), num_rows = 0;
           start < context_len; start += num_rows) {
        const int64_t first_row = start % block_size;
        num_rows = std::min(block_size - first_row, context_len - start);
        // NOTE: a block holds all KV heads of its rows contiguously, so reading every head of
        // a row at once streams the block front to back.
        const int64_t offset =
            block_table[start / block_size] * block_stride + first_row * row_stride;
        const cache_t* k_block = k_data + offset;
        const cache_t* v_block = v_data + offset;
        const bool has_next = start + num_rows < context_len;
        const int64_t next = has_next ? block_table[start / block_size + 1] * block_stride : 0;

        const float* k_rows = as_float(k_block, num_rows * row_stride, kv_buf.data());
        for (int64_t j = 0; j < num_rows; ++j) {
          if (has_next) {
            prefetch_row(k_data + next + j * row_stride, row_stride);
            prefetch_row(v_data + next + j * row_stride, row_stride);
          }
          const float* k_row = k_rows + j * row_stride;
          for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
            dot_heads(group, q_buf.data() + kv * group * head_dim, head_dim,
                      k_row + kv * head_dim, head_dim, scores.data() + kv * group * block_size + j,
                      block_size);
          }
        }
        if (rule.softcap > 0.0f) {
          for (int64_t h = 0; h < num_heads; ++h) {
            softcap_scores(scores.data() + h * block_size, num_rows, rule.softcap);
          }
        }

        for (int64_t h = 0; h < num_heads; ++h) {
          float* s = scores.data() + h * block_size;
          const float block_max = *std::max_element(s, s + num_rows);
          const float new_max = std::max(running_max[h], block_max);
          const float correction = std::exp(running_max[h] - new_max);
          float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
          for (int64_t j = 0; j < num_rows; ++j) {
            s[j] = fast_exp(s[j] - new_max);
            block_sum += s[j];
          }
          running_sum[h] = running_sum[h] * correction + block_sum;
          running_max[h] = new_max;
          if (correction != 1.0f) {
            float* acc_h = acc.data() + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) acc_h[d] *= correction;
          }
        }

        const float* v_rows = as_float(v_block, num_rows * row_stride, kv_buf.data());
        for (int64_t h = 0; h < num_heads; ++h) {
          add_weighted_rows(acc.data() + h * head_dim, scores.data() + h * block_size,
                            v_rows + (h / group) * head_dim, num_rows, row_stride, head_dim);
        }
      }

      for (int64_t h = 0; h < num_heads; ++h) {
        const float inv_sum = 1.0f / running_sum[h];
        scalar_t* out_row = out_data + (token * num_heads + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
          out_row[d] = static_cast<scalar_t>(acc[h * head_dim + d] * inv_sum);
        }
      }
    }
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Rows per step of the two-phase decode kernel: one vector (16 lanes under AVX-512, 8 under
// AVX2) holds a head's scores for a step.
constexpr int64_t kStepRows = kNumLanes;
// Steps per chunk: a chunk's scores, [num_heads, 1024] floats, stay in L2.
constexpr int64_t kMaxChunkSteps = 1024 / kStepRows;
// Vector registers step_values may keep accumulators in: 16 of AVX-512's 32, 12 of AVX2's 16
// (the rest hold the row's weights and its V chunk).
constexpr int kAccumulators = kNumLanes == 16 ? 16 : 12;

// Prefetches the cache lines of the next step, a few per row of the current one.
// NOTE: one burst of hundreds of prefetches fills the load queue and stalls the compute that is
// meant to hide them (measured: slower than no prefetch at all); spread out, they keep memory
// busy while the step computes.
class LinePrefetcher {
 public:
  void aim(const void* start, int64_t num_bytes, int64_t num_calls) {
    next_ = static_cast<const char*>(start);
    end_ = next_ + num_bytes;
    bytes_per_call_ = ((num_bytes + 63) / 64 + num_calls - 1) / num_calls * 64;
  }
  void advance() {
    const char* stop = next_ + std::min<int64_t>(bytes_per_call_, end_ - next_);
    for (; next_ < stop; next_ += 64) prefetch_line(next_);
  }

 private:
  const char* next_ = nullptr;
  const char* end_ = nullptr;
  int64_t bytes_per_call_ = 0;
};

// Scores of NH query heads (sharing one KV head) against one step's K rows.
// q: [NH, NC * kNumLanes] scaled, zero past head_dim; k_rows: num_rows rows `stride` apart;
// masks: the valid lanes of each chunk of a row; softcap > 0 caps the scores. scores: NH vectors
// of kStepRows, `scores_stride` apart; lanes past num_rows are -inf.
template <int NC, int NH>
inline void step_scores(const float* q, const float* k_rows, int64_t stride, int64_t num_rows,
                        const LaneMask* masks, float softcap, float* scores,
                        int64_t scores_stride, LinePrefetcher& prefetcher) {
  Lanes partial[NH][kStepRows];  // per head and row: a vector of partial sums of the dot product
  for (int64_t j = 0; j < kStepRows; ++j) {
    Lanes sum[NH];
    for (int h = 0; h < NH; ++h) sum[h] = lanes_zero();
    if (j < num_rows) {
      prefetcher.advance();
      for (int c = 0; c < NC; ++c) {
        const Lanes k = lanes_load_masked(k_rows + j * stride + c * kNumLanes, masks[c]);
        for (int h = 0; h < NH; ++h) {
          sum[h] = lanes_fmadd(lanes_load(q + (h * NC + c) * kNumLanes), k, sum[h]);
        }
      }
    }
    for (int h = 0; h < NH; ++h) partial[h][j] = sum[h];
  }
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int h = 0; h < NH; ++h) {
    Lanes sums = lanes_transpose_sum(partial[h]);
    if (softcap > 0.0f) sums = lanes_softcap(sums, softcap);
    lanes_store(scores + h * scores_stride, lanes_fill_from(sums, num_rows, minus_inf));
  }
}

// acc[h] = acc[h] * correction[h] + sum_j probs[h][j] * v_row[j] for NH heads sharing one KV
// head; acc: [NH, NC * kNumLanes]; probs: NH vectors `probs_stride` apart; a null correction
// means 1. The chunks go in blocks whose NH x block accumulators fit in registers (one block
// under AVX-512; under AVX2 each block reads the step's rows again, from L1).
template <int NC, int NH>
inline void step_values(float* acc, const float* correction, const float* probs,
                        int64_t probs_stride, const float* v_rows, int64_t stride,
                        int64_t num_rows, const LaneMask* masks, LinePrefetcher& prefetcher) {
  constexpr int kBlock = std::min(NC, std::max(1, kAccumulators / NH));
  for (int first = 0; first < NC; first += kBlock) {
    Lanes sum[NH][kBlock];
    for (int h = 0; h < NH; ++h) {
      const Lanes scale = lanes_set1(correction != nullptr ? correction[h] : 1.0f);
      for (int c = 0; c < kBlock && first + c < NC; ++c) {
        sum[h][c] = lanes_mul(lanes_load(acc + (h * NC + first + c) * kNumLanes), scale);
      }
    }
    for (int64_t j = 0; j < num_rows; ++j) {
      if (first == 0) prefetcher.advance();
      Lanes p[NH];
      for (int h = 0; h < NH; ++h) p[h] = lanes_set1(probs[h * probs_stride + j]);
      for (int c = 0; c < kBlock && first + c < NC; ++c) {
        const Lanes v =
            lanes_load_masked(v_rows + j * stride + (first + c) * kNumLanes, masks[first + c]);
        for (int h = 0; h < NH; ++h) sum[h][c] = lanes_fmadd(p[h], v, sum[h][c]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      for (int c = 0; c < kBlock && first + c < NC; ++c) {
        lanes_store(acc + (h * NC + first + c) * kNumLanes, sum[h][c]);
      }
    }
  }
}

// Calls fn(std::integral_constant<int, num_heads>) for num_heads in 1..4.
template <typename F>
inline void with_num_heads(int num_heads, F&& fn) {
  switch (num_heads) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    default: fn(std::integral_constant<int, 4>{}); break;
  }
}

// The decode kernel under AVX-512 or AVX2 for head_dim <= NC * kNumLanes. Per token and chunk
// of up to kMaxChunkSteps steps (a step: up to kStepRows rows of one block): every K row of the
// chunk, one softmax update per head, then every V row; each phase is one stream, prefetched a
// step ahead. Invariant: between chunks, acc holds sum_j exp(s_j - running_max) v_j over the rows
// done and running_sum the sum of those weights.
template <int NC, typename scalar_t, typename cache_t>
void two_phase_attention_impl(const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const std::vector<int64_t>& tokens,
                              const std::vector<int64_t>& token_seq,
                              const int32_t* query_start_loc, const int32_t* seq_lens,
                              const int32_t* block_tables, int64_t max_num_blocks,
                              const ScoreRule& rule, at::Tensor& out) {
  const int64_t num_tokens = static_cast<int64_t>(tokens.size());
  if (num_tokens == 0) return;
  const auto [num_heads, head_dim, block_size, num_kv_heads, group, q_token_stride,
              q_head_stride, row_stride, block_stride] = attention_shape(q, k_cache);
  const float scale = rule.scale;
  constexpr int64_t kPadded = NC * kNumLanes;
  constexpr int64_t kScoresStride = kMaxChunkSteps * kStepRows;
  // NOTE: under AVX-512 step_values keeps all [heads, chunks] accumulators in registers; under
  // AVX2 it splits the chunks into blocks instead, so that one V row serves a GQA group of 3-4.
  constexpr int64_t kMaxHeadsPerCall = kNumLanes == 16 ? std::min(4, kAccumulators / NC) : 4;
  const int64_t num_calls_per_row =
      num_kv_heads * ((group + kMaxHeadsPerCall - 1) / kMaxHeadsPerCall);
  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  const cache_t* k_data = k_cache.const_data_ptr<cache_t>();
  const cache_t* v_data = v_cache.const_data_ptr<cache_t>();
  scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
  LaneMask masks[NC];
  for (int c = 0; c < NC; ++c) {
    masks[c] = lanes_mask_first(std::max<int64_t>(0, head_dim - c * kNumLanes));
  }
  const Lanes minus_inf = lanes_set1(-std::numeric_limits<float>::infinity());
  const int num_threads = at::get_num_threads();

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> q_buf(num_heads * kPadded, 0.0f), acc(num_heads * kPadded);
    std::vector<float> scores(num_heads * kScoresStride), kv_buf(kStepRows * row_stride);
    std::vector<float> running_max(num_heads), running_sum(num_heads), correction(num_heads);
    int64_t step_offset[kMaxChunkSteps], step_rows[kMaxChunkSteps];
    LinePrefetcher prefetcher;

    // NOTE: dynamic scheduling because contexts differ in length.
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tokens; ++i) {
      const int64_t token = tokens[i];
      const int64_t seq = token_seq[token];
      const int64_t context_len = causal_context_len(token, seq, query_start_loc, seq_lens);
      const int32_t* block_table = block_tables + seq * max_num_blocks;
      // The step at `pos`: the cache offset of its first row; its rows, all in one block.
      auto step_at = [&](int64_t pos, int64_t* num_rows) {
        const int64_t row = pos % block_size;
        *num_rows = std::min({kStepRows, block_size - row, context_len - pos});
        return block_table[pos / block_size] * block_stride + row * row_stride;
      };
      // Spreads the prefetch of `num_rows` rows at `start` over the rows of a step of `over`.
      auto aim = [&](const cache_t* start, int64_t num_rows, int64_t over) {
        prefetcher.aim(start, num_rows * row_stride * static_cast<int64_t>(sizeof(cache_t)),
                       over * num_calls_per_row);
      };
      // Calls fn(first head, its KV head, NH) for every batch of heads sharing a KV head.
      auto for_head_batches = [&](auto&& fn) {
        for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
          for (int64_t g = 0; g < group; g += kMaxHeadsPerCall) {
            const int nh = static_cast<int>(std::min(kMaxHeadsPerCall, group - g));
            with_num_heads(nh, [&](auto heads) { fn(kv_head * group + g, kv_head, heads); });
          }
        }
      };

      for (int64_t h = 0; h < num_heads; ++h) {
        const scalar_t* q_row = q_data + token * q_token_stride + h * q_head_stride;
        for (int64_t d = 0; d < head_dim; ++d) {
          q_buf[h * kPadded + d] = static_cast<float>(q_row[d]) * scale;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(running_sum.begin(), running_sum.end(), 0.0f);

      for (int64_t chunk_start = window_start(context_len, rule.window);
           chunk_start < context_len;) {
        int64_t num_steps = 0, chunk_end = chunk_start;
        for (; chunk_end < context_len && num_steps < kMaxChunkSteps; ++num_steps) {
          step_offset[num_steps] = step_at(chunk_end, &step_rows[num_steps]);
          chunk_end += step_rows[num_steps];
        }

        for (int64_t t = 0; t < num_steps; ++t) {
          const int64_t num_rows = step_rows[t];
          if (t + 1 < num_steps) {
            aim(k_data + step_offset[t + 1], step_rows[t + 1], num_rows);
          } else {
            aim(v_data + step_offset[0], step_rows[0], num_rows);
          }
          const float* k_rows =
              as_float(k_data + step_offset[t], num_rows * row_stride, kv_buf.data());
          for_head_batches([&](int64_t h, int64_t kv_head, auto heads) {
            step_scores<NC, decltype(heads)::value>(
                q_buf.data() + h * kPadded, k_rows + kv_head * head_dim, row_stride, num_rows,
                masks, rule.softcap, scores.data() + h * kScoresStride + t * kStepRows,
                kScoresStride, prefetcher);
          });
        }

        for (int64_t h = 0; h < num_heads; ++h) {
          float* s = scores.data() + h * kScoresStride;
          Lanes chunk_max = minus_inf;
          for (int64_t t = 0; t < num_steps; ++t) {
            chunk_max = lanes_max(chunk_max, lanes_load(s + t * kStepRows));
          }
          const float new_max = std::max(running_max[h], lanes_reduce_max(chunk_max));
          correction[h] = fast_exp(running_max[h] - new_max);
          Lanes chunk_sum = lanes_zero();
          for (int64_t t = 0; t < num_steps; ++t) {
            const Lanes x = lanes_load(s + t * kStepRows);
            const Lanes p =
                lanes_zero_where_neg_inf(x, lanes_exp(lanes_sub(x, lanes_set1(new_max))));
            chunk_sum = lanes_add(chunk_sum, p);
            lanes_store(s + t * kStepRows, p);
          }
          running_sum[h] = running_sum[h] * correction[h] + lanes_reduce_add(chunk_sum);
          running_max[h] = new_max;
        }

        for (int64_t t = 0; t < num_steps; ++t) {
          const int64_t num_rows = step_rows[t];
          if (t + 1 < num_steps) {
            aim(v_data + step_offset[t + 1], step_rows[t + 1], num_rows);
          } else if (chunk_end < context_len) {
            int64_t next_rows = 0;
            const int64_t next_offset = step_at(chunk_end, &next_rows);
            aim(k_data + next_offset, next_rows, num_rows);
          } else {
            aim(v_data, 0, num_rows);
          }
          const float* v_rows =
              as_float(v_data + step_offset[t], num_rows * row_stride, kv_buf.data());
          for_head_batches([&](int64_t h, int64_t kv_head, auto heads) {
            step_values<NC, decltype(heads)::value>(
                acc.data() + h * kPadded, t == 0 ? correction.data() + h : nullptr,
                scores.data() + h * kScoresStride + t * kStepRows, kScoresStride,
                v_rows + kv_head * head_dim, row_stride, num_rows, masks, prefetcher);
          });
        }
        chunk_start = chunk_end;
      }

      for (int64_t h = 0; h < num_heads; ++h) {
        const float inv_sum = 1.0f / running_sum[h];
        scalar_t* out_row = out_data + (token * num_heads + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
          out_row[d] = static_cast<scalar_t>(acc[h * kPadded + d] * inv_sum);
        }
      }
    }
  }
}
#endif

// Attends the rows `tokens` one at a time: by two_phase_attention_impl where it applies
// (AVX-512 or AVX2 with FMA, head_dim <= 128), else by per_token_attention_impl.
template <typename scalar_t, typename cache_t>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const std::vector<int64_t>& tokens, const std::vector<int64_t>& token_seq,
                      const int32_t* query_start_loc, const int32_t* seq_lens,
                      const int32_t* block_tables, int64_t max_num_blocks,
                      const ScoreRule& rule, at::Tensor& out) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const int64_t head_dim = q.size(2);
  auto two_phase = [&](auto num_chunks) {
    two_phase_attention_impl<decltype(num_chunks)::value, scalar_t, cache_t>(
        q, k_cache, v_cache, tokens, token_seq, query_start_loc, seq_lens, block_tables,
        max_num_blocks, rule, out);
  };
  if (head_dim <= kNumLanes) return two_phase(std::integral_constant<int, 1>{});
  if (head_dim <= 2 * kNumLanes) return two_phase(std::integral_constant<int, 2>{});
  if (head_dim <= 4 * kNumLanes) return two_phase(std::integral_constant<int, 4>{});
  if (head_dim <= 8 * kNumLanes) return two_phase(std::integral_constant<int, 8>{});
  if constexpr (kNumLanes == 8) {
    if (head_dim <= 128) return two_phase(std::integral_constant<int, 16>{});
  }
#endif
  per_token_attention_impl<scalar_t, cache_t>(q, k_cache, v_cache, tokens, token_seq,
                                              query_start_loc, seq_lens, block_tables,
                                              max_num_blocks, rule, out);
}

// Without prompt_chunks, sequences with more query rows than this attend by tiles. With it, the
// flagged sequences (prefill chunks, of any length) do and the others go row by row, so that a
// prompt position's attention does not depend on how its prompt was chunked or prefix-cached:
// a tile lane's result does not depend on the tile's other lanes, and both paths round
// differently.
constexpr int64_t kMaxPerTokenQueryLen = 8;

// One work item of the tiled kernel: up to kNumLanes consecutive query rows of one sequence,
// against one KV head (so for every query head of its GQA group).
struct Tile {
  int64_t seq;
  int64_t first_row;  // q row of lane 0
  int64_t num_rows;   // valid lanes, 1..kNumLanes
  int64_t kv_head;
  int64_t context_len;  // keys the tile's last row sees
};

// Consecutive tiles of one sequence and KV head, [begin, end) in the tile list, attended in
// order by one thread: each tile's context is the last one's plus its own rows, so most of the
// K/V it reads is still in that core's L2.
struct TileRun {
  int64_t begin;
  int64_t end;
  int64_t work;  // keys summed over the run's tiles
};

// Tiles per run: enough for the L2 reuse, few enough that one long prompt still makes many
// runs to share among threads.
constexpr int64_t kTilesPerRun = 4;

// The score a masked key gets in the tiled kernel: finite, so that a lane whose every key in a
// step is masked (before its sliding window starts) keeps a finite running max; its weight
// exp(kMaskedScore - max) underflows to ~0 as soon as the lane sees a real key.
constexpr float kMaskedScore = -1e30f;

// Online-softmax step of one query head's tile over kNumLanes keys, all in registers.
// q_t: [head_dim, kNumLanes] (scaled), o_t: [head_dim, kNumLanes] unnormalised output; k_rows
// and v_rows: kNumLanes rows of head_dim floats, `stride` apart. D > 0 fixes head_dim and the
// stride to D at compile time, so that the keys' 16 rows are one base address plus constant
// offsets (a runtime stride needed a register per row, and the spilled ones went through vector
// registers on every load). With `seen_from` given, key j is seen only by lanes [seen_from[j],
// seen_to[j]); softcap > 0 caps the scores. running_max and running_sum: kNumLanes floats each,
// carried from step to step.
template <int64_t D>
inline void tile_step(const float* q_t, float* o_t, float* running_max, float* running_sum,
                      const float* k_rows, const float* v_rows, int64_t stride,
                      int64_t head_dim, float softcap, const int64_t* seen_from,
                      const int64_t* seen_to) {
  if constexpr (D > 0) {
    head_dim = D;
    stride = D;
  }
  Lanes s[kNumLanes];
#pragma GCC unroll 16
  for (int64_t j = 0; j < kNumLanes; ++j) s[j] = lanes_zero();
  for (int64_t d = 0; d < head_dim; ++d) {
    const Lanes q_d = lanes_load(q_t + d * kNumLanes);
#pragma GCC unroll 16
    for (int64_t j = 0; j < kNumLanes; ++j) {
      s[j] = lanes_fmadd(lanes_set1(k_rows[j * stride + d]), q_d, s[j]);
    }
  }
  if (softcap > 0.0f) {
    for (int64_t j = 0; j < kNumLanes; ++j) s[j] = lanes_softcap(s[j], softcap);
  }
  if (seen_from != nullptr) {
#pragma GCC unroll 16
    for (int64_t j = 0; j < kNumLanes; ++j) {
      s[j] = lanes_fill_from(lanes_fill_first(s[j], seen_from[j], kMaskedScore), seen_to[j],
                             kMaskedScore);
    }
  }
  Lanes block_max = s[0];
#pragma GCC unroll 16
  for (int64_t j = 1; j < kNumLanes; ++j) block_max = lanes_max(block_max, s[j]);
  const Lanes old_max = lanes_load(running_max);
  const Lanes new_max = lanes_max(old_max, block_max);
  const Lanes correction = lanes_exp(lanes_sub(old_max, new_max));
  lanes_store(running_max, new_max);
  Lanes block_sum = lanes_zero();
#pragma GCC unroll 16
  for (int64_t j = 0; j < kNumLanes; ++j) {
    s[j] = lanes_exp(lanes_sub(s[j], new_max));
    block_sum = lanes_add(block_sum, s[j]);
  }
  lanes_store(running_sum, lanes_fmadd(lanes_load(running_sum), correction, block_sum));
  // NOTE: kOutputDims output dims at a time: each is a chain of kNumLanes dependent FMAs, and
  // one chain alone waits on the FMA latency at every step. Each chain keeps its order, so the
  // bits do not depend on how many go together. Under AVX-512 (Zen 4, 2 threads, 16 chunks of
  // 100-250 tokens) 8 rather than 4 took 220-222 against 231-246 ms a step in 3 pairs, and
  // 222-245 against 232-257 in 4 later pairs on a noisier host; under AVX2, with half the
  // registers, 8 was no faster.
  constexpr int64_t kOutputDims = kNumLanes / 2;
  int64_t d = 0;
  for (; d + kOutputDims <= head_dim; d += kOutputDims) {
    Lanes o[kOutputDims];
#pragma GCC unroll 8
    for (int64_t i = 0; i < kOutputDims; ++i) {
      o[i] = lanes_mul(lanes_load(o_t + (d + i) * kNumLanes), correction);
    }
#pragma GCC unroll 16
    for (int64_t j = 0; j < kNumLanes; ++j) {
#pragma GCC unroll 8
      for (int64_t i = 0; i < kOutputDims; ++i) {
        o[i] = lanes_fmadd(lanes_set1(v_rows[j * stride + d + i]), s[j], o[i]);
      }
    }
#pragma GCC unroll 8
    for (int64_t i = 0; i < kOutputDims; ++i) lanes_store(o_t + (d + i) * kNumLanes, o[i]);
  }
  for (; d < head_dim; ++d) {
    Lanes o = lanes_mul(lanes_load(o_t + d * kNumLanes), correction);
#pragma GCC unroll 16
    for (int64_t j = 0; j < kNumLanes; ++j) {
      o = lanes_fmadd(lanes_set1(v_rows[j * stride + d]), s[j], o);
    }
    lanes_store(o_t + d * kNumLanes, o);
  }
}

// Attends every tile: per tile, each kNumLanes-key step of its context loads K/V once for the
// tile's tokens and the group's heads. Keys come straight from a float32 cache when a step's
// keys share a block, else they are copied (widened, zero-padded) into a scratch block. No slot
// outside the context, or before the tile's first query's window, is read.
template <int64_t D, typename scalar_t, typename cache_t>
void tiled_attention_run(const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const std::vector<Tile>& tiles,
                         const std::vector<TileRun>& runs, const int32_t* block_tables,
                         int64_t max_num_blocks, const ScoreRule& rule, at::Tensor& out) {
  const int64_t num_runs = static_cast<int64_t>(runs.size());
  const auto [num_heads, head_dim, block_size, num_kv_heads, group, q_token_stride,
              q_head_stride, row_stride, block_stride] = attention_shape(q, k_cache);
  // NOTE: with a compile-time head_dim, every step's rows are copied: the copy costs less than
  // the runtime stride of reading them in place.
  const bool is_direct =
      D == 0 && std::is_same_v<cache_t, float> && block_size % kNumLanes == 0;
  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  const cache_t* k_data = k_cache.const_data_ptr<cache_t>();
  const cache_t* v_data = v_cache.const_data_ptr<cache_t>();
  scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
  const float scale = rule.scale;
  const int num_threads = at::get_num_threads();

#pragma omp parallel num_threads(num_threads)
  {
    // [group, head_dim, kNumLanes] each
    std::vector<float> q_t(group * head_dim * kNumLanes), o_t(group * head_dim * kNumLanes);
    // [kNumLanes, head_dim] each
    std::vector<float> k_buf(kNumLanes * head_dim), v_buf(kNumLanes * head_dim);
    // [group, kNumLanes] each
    std::vector<float> running_max(group * kNumLanes), running_sum(group * kNumLanes);
    int64_t seen_from[kNumLanes], seen_to[kNumLanes];

#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < num_runs; ++r) {
      for (int64_t i = runs[r].begin; i < runs[r].end; ++i) {
        const Tile& tile = tiles[i];
        const int32_t* block_table = block_tables + tile.seq * max_num_blocks;
        // NOTE: lane l holds the query at position first_pos + l; padding lanes stay zero.
        const int64_t first_pos = tile.context_len - tile.num_rows;
        // NOTE: a full tile of a float32 q goes in and out by register transposes of square
        // blocks: the same values as the scalar loops (the same bits out), at a fraction of
        // their loads and stores, which took ~20% of the e2e job's prefill attention. On the
        // AVX-512 EPYC (Zen 4), its 64 prompts' attention in one layer ran at 105-133 against
        // 97-124 GFLOP/s (2 threads, 2 interleaved rounds); held to AVX2, 3-5% faster.
        const bool is_full = std::is_same_v<scalar_t, float> && tile.num_rows == kNumLanes &&
                             head_dim % kNumLanes == 0;
        if (!is_full) std::fill(q_t.begin(), q_t.end(), 0.0f);
        std::fill(o_t.begin(), o_t.end(), 0.0f);
        std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
        std::fill(running_sum.begin(), running_sum.end(), 0.0f);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = tile.kv_head * group + g;
          float* q_head = q_t.data() + g * head_dim * kNumLanes;
          if constexpr (std::is_same_v<scalar_t, float>) {
            if (is_full) {
              const float* q_first = q_data + tile.first_row * q_token_stride + h * q_head_stride;
              for (int64_t c = 0; c < head_dim; c += kNumLanes) {
                lanes_transpose(q_first + c, q_token_stride, q_head + c * kNumLanes, kNumLanes);
              }
              const Lanes scale_lanes = lanes_set1(scale);
              for (int64_t i = 0; i < head_dim * kNumLanes; i += kNumLanes) {
                lanes_store(q_head + i, lanes_mul(lanes_load(q_head + i), scale_lanes));
              }
              continue;
            }
          }
          for (int64_t l = 0; l < tile.num_rows; ++l) {
            const scalar_t* q_row =
                q_data + (tile.first_row + l) * q_token_stride + h * q_head_stride;
            for (int64_t d = 0; d < head_dim; ++d) {
              q_head[d * kNumLanes + l] = static_cast<float>(q_row[d]) * scale;
            }
          }
        }

        // NOTE: steps stay kNumLanes-aligned (a float32 cache is read in place); with a window
        // they start at lane 0's first key, and a later lane's earlier keys are masked.
        const int64_t first_key = window_start(first_pos + 1, rule.window);
        for (int64_t start = first_key - first_key % kNumLanes; start < tile.context_len;
             start += kNumLanes) {
          const int64_t num_keys = std::min(kNumLanes, tile.context_len - start);
          const float* k_rows;
          const float* v_rows;
          int64_t stride;
          // NOTE: keys before lane 0's window are no lane's; they are zeros, never read.
          if (is_direct && num_keys == kNumLanes && start >= first_key) {
            const int64_t offset = block_table[start / block_size] * block_stride +
                                   (start % block_size) * row_stride + tile.kv_head * head_dim;
            k_rows = reinterpret_cast<const float*>(k_data + offset);
            v_rows = reinterpret_cast<const float*>(v_data + offset);
            stride = row_stride;
          } else {
            int64_t block = start / block_size, block_row = start % block_size;
            for (int64_t j = 0; j < kNumLanes; ++j, ++block_row) {
              if (block_row == block_size) {
                ++block;
                block_row = 0;
              }
              float* k_dst = k_buf.data() + j * head_dim;
              float* v_dst = v_buf.data() + j * head_dim;
              if (j < num_keys && start + j >= first_key) {
                const int64_t offset = block_table[block] * block_stride + block_row * row_stride +
                                       tile.kv_head * head_dim;
                widen(k_data + offset, head_dim, k_dst);
                widen(v_data + offset, head_dim, v_dst);
              } else {
                std::fill_n(k_dst, head_dim, 0.0f);
                std::fill_n(v_dst, head_dim, 0.0f);
              }
            }
            k_rows = k_buf.data();
            v_rows = v_buf.data();
            stride = head_dim;
          }
          // NOTE: the next step's K/V rows, or on the tile's last step the next tile's q rows,
          // are asked for while this step computes (6-10% faster on AVX-512 Zen 4: those loads
          // had stalled the copy into the scratch block and the q transpose).
          if (start + kNumLanes < tile.context_len) {
            const int64_t next = start + kNumLanes;
            for (int64_t pos = next; pos < std::min(next + kNumLanes, tile.context_len); ++pos) {
              const int64_t offset = block_table[pos / block_size] * block_stride +
                                     (pos % block_size) * row_stride + tile.kv_head * head_dim;
              prefetch_row(k_data + offset, head_dim);
              prefetch_row(v_data + offset, head_dim);
            }
          } else if (i + 1 < runs[r].end) {
            const Tile& next_tile = tiles[i + 1];
            for (int64_t g = 0; g < group; ++g) {
              const int64_t h = next_tile.kv_head * group + g;
              const scalar_t* q_head = q_data + h * q_head_stride;
              for (int64_t l = 0; l < next_tile.num_rows; ++l) {
                prefetch_row(q_head + (next_tile.first_row + l) * q_token_stride, head_dim);
              }
            }
          }
          // NOTE: only steps reaching past the tile's first position need the causal mask, and
          // only steps before its last lane's window start need the window's.
          const bool is_masked =
              start + kNumLanes - 1 > first_pos ||
              (rule.window > 0 && start < first_pos + kNumLanes - rule.window);
          if (is_masked) {
            // Key start + j is seen by lanes l with start + j <= first_pos + l (causal) and
            // first_pos + l - window < start + j (window).
            for (int64_t j = 0; j < kNumLanes; ++j) {
              seen_from[j] = std::clamp<int64_t>(start + j - first_pos, 0, kNumLanes);
              seen_to[j] = rule.window > 0
                               ? std::clamp<int64_t>(start + j - first_pos + rule.window, 0,
                                                     kNumLanes)
                               : kNumLanes;
            }
          }
          for (int64_t g = 0; g < group; ++g) {
            tile_step<D>(q_t.data() + g * head_dim * kNumLanes,
                         o_t.data() + g * head_dim * kNumLanes, running_max.data() + g * kNumLanes,
                         running_sum.data() + g * kNumLanes, k_rows, v_rows, stride, head_dim,
                         rule.softcap, is_masked ? seen_from : nullptr, seen_to);
          }
        }

        for (int64_t g = 0; g < group; ++g) {
          const float* sums = running_sum.data() + g * kNumLanes;
          const float* o_head = o_t.data() + g * head_dim * kNumLanes;
          const int64_t h = tile.kv_head * group + g;
          if constexpr (std::is_same_v<scalar_t, float>) {
            if (is_full) {
              alignas(64) float rows[kNumLanes * kNumLanes];
              float* out_first = out_data + (tile.first_row * num_heads + h) * head_dim;
              for (int64_t c = 0; c < head_dim; c += kNumLanes) {
                lanes_transpose(o_head + c * kNumLanes, kNumLanes, rows, kNumLanes);
                for (int64_t l = 0; l < kNumLanes; ++l) {
                  const Lanes inv_sum = lanes_set1(1.0f / sums[l]);
                  lanes_store(out_first + l * num_heads * head_dim + c,
                              lanes_mul(lanes_load(rows + l * kNumLanes), inv_sum));
                }
              }
              continue;
            }
          }
          for (int64_t l = 0; l < tile.num_rows; ++l) {
            const float inv_sum = 1.0f / sums[l];
            scalar_t* out_row = out_data + ((tile.first_row + l) * num_heads + h) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) {
              out_row[d] = static_cast<scalar_t>(o_head[d * kNumLanes + l] * inv_sum);
            }
          }
        }
      }
    }
  }
}

// Attends every tile (see tiled_attention_run), with the head dim fixed at compile time where
// it is a common one.
template <typename scalar_t, typename cache_t>
void tiled_attention_impl(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const std::vector<Tile>& tiles,
                          const std::vector<TileRun>& runs, const int32_t* block_tables,
                          int64_t max_num_blocks, const ScoreRule& rule, at::Tensor& out) {
  if (runs.empty()) return;
  const auto run = [&](auto head_dim) {
    tiled_attention_run<decltype(head_dim)::value, scalar_t, cache_t>(
        q, k_cache, v_cache, tiles, runs, block_tables, max_num_blocks, rule, out);
  };
  switch (q.size(2)) {
    case 64: return run(std::integral_constant<int64_t, 64>{});
    case 128: return run(std::integral_constant<int64_t, 128>{});
    default: return run(std::integral_constant<int64_t, 0>{});
  }
}

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& query_start_loc,
                               const at::Tensor& seq_lens, const at::Tensor& block_tables,
                               double scale, int64_t sliding_window, double softcap,
                               const std::optional<at::Tensor>& prompt_chunks) {
  check_paged_attention_args(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                             /*can_cache_be_16bit=*/true);
  TORCH_CHECK(sliding_window >= 0 && softcap >= 0.0,
              "sliding_window and softcap must be >= 0 (0: off)");
  const ScoreRule rule{static_cast<float>(scale), sliding_window, static_cast<float>(softcap)};
  const int64_t num_tokens = q.size(0), num_seqs = seq_lens.size(0);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t max_num_blocks = block_tables.size(1);
  const int32_t* starts = query_start_loc.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int32_t* is_prompt_chunk = nullptr;
  if (prompt_chunks.has_value()) {
    TORCH_CHECK(prompt_chunks->device().is_cpu() && prompt_chunks->scalar_type() == at::kInt &&
                    prompt_chunks->is_contiguous() && prompt_chunks->numel() == num_seqs,
                "prompt_chunks must be a contiguous int32 CPU tensor with one entry per sequence");
    is_prompt_chunk = prompt_chunks->const_data_ptr<int32_t>();
  }

  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == num_tokens,
              "query_start_loc must run from 0 to num_tokens");
  std::vector<int64_t> token_seq(num_tokens), tokens;
  std::vector<Tile> tiles;
  std::vector<TileRun> runs;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t query_len = starts[seq + 1] - starts[seq];
    TORCH_CHECK(query_len >= 0 && query_len <= lens[seq],
                "each sequence needs 0 <= query_len <= seq_len");
    const int64_t num_used = (lens[seq] + block_size - 1) / block_size;
    TORCH_CHECK(num_used <= max_num_blocks, "block_tables is too narrow for seq_lens");
    for (int64_t b = 0; b < num_used; ++b) {
      const int32_t block = tables[seq * max_num_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " is out of range");
    }
    std::fill(token_seq.begin() + starts[seq], token_seq.begin() + starts[seq + 1], seq);
    const bool is_tiled = is_prompt_chunk != nullptr ? is_prompt_chunk[seq] != 0
                                                     : query_len > kMaxPerTokenQueryLen;
    if (!is_tiled) {
      for (int64_t token = starts[seq]; token < starts[seq + 1]; ++token) tokens.push_back(token);
      continue;
    }
    for (int64_t kv_head = 0; kv_head < k_cache.size(2); ++kv_head) {
      for (int64_t first = 0; first < query_len; first += kNumLanes) {
        const int64_t num_rows = std::min(kNumLanes, query_len - first);
        const int64_t context_len = lens[seq] - query_len + first + num_rows;
        const int64_t index = static_cast<int64_t>(tiles.size());
        tiles.push_back({seq, starts[seq] + first, num_rows, kv_head, context_len});
        if (first % (kTilesPerRun * kNumLanes) == 0) {
          runs.push_back({index, index, 0});
        }
        runs.back().end = index + 1;
        runs.back().work += context_len;
      }
    }
  }
  // NOTE: the most work first, so the dynamic schedule ends on short items.
  std::stable_sort(runs.begin(), runs.end(),
                   [](const TileRun& a, const TileRun& b) { return a.work > b.work; });

  at::Tensor out = at::empty(q.sizes(), q.options());
  const bool is_widened = q.scalar_type() != k_cache.scalar_type();
  VBATCH_DISPATCH_KV_TYPES(k_cache.scalar_type(), "paged_attention_cpu", [&] {
    using cache_t = scalar_t;
    if (is_widened) {
      tiled_attention_impl<float, cache_t>(q, k_cache, v_cache, tiles, runs, tables,
                                           max_num_blocks, rule, out);
      decode_attention<float, cache_t>(q, k_cache, v_cache, tokens, token_seq, starts, lens,
                                       tables, max_num_blocks, rule, out);
    } else {
      tiled_attention_impl<cache_t, cache_t>(q, k_cache, v_cache, tiles, runs, tables,
                                             max_num_blocks, rule, out);
      decode_attention<cache_t, cache_t>(q, k_cache, v_cache, tokens, token_seq, starts, lens,
                                         tables, max_num_blocks, rule, out);
    }
  });
  return out;
}

// Writes k, v [T, KVH, D] (scalar_t) into the caches' slots (cache_t); a negative slot is skipped.
template <typename scalar_t, typename cache_t>
void copy_to_cache(const at::Tensor& k, const at::Tensor& v, cache_t* k_cache_data,
                   cache_t* v_cache_data, const int64_t* slots) {
  const int64_t num_tokens = k.size(0), num_kv_heads = k.size(1), head_dim = k.size(2);
  const scalar_t* k_data = k.const_data_ptr<scalar_t>();
  const scalar_t* v_data = v.const_data_ptr<scalar_t>();
  // NOTE: a decode batch's rows land on cold lines, often on pages not yet faulted in, so its
  // copy is split from 32 rows on: on the AVX-512 EPYC (Zen 4) at 2 threads, 64 rows into
  // fresh slots took 68-87 us a call against 108-137 us on one thread (16-17 against 25-34 us
  // into touched pages).
  const int64_t grain = 16;
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = (slots[t] * num_kv_heads + h) * head_dim;
        const scalar_t* k_row = k_data + t * k.stride(0) + h * k.stride(1);
        const scalar_t* v_row = v_data + t * v.stride(0) + h * v.stride(1);
        if constexpr (std::is_same_v<scalar_t, cache_t>) {
          std::copy_n(k_row, head_dim, k_cache_data + dst);
          std::copy_n(v_row, head_dim, v_cache_data + dst);
        } else {
          store_as(k_row, head_dim, k_cache_data + dst);
          store_as(v_row, head_dim, v_cache_data + dst);
        }
      }
    }
  });
}

// NOTE: a negative slot marks a padding token and is skipped.
void reshape_and_cache_cpu(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_reshape_and_cache_args(k, v, k_cache, v_cache, slot_mapping, /*can_cache_be_16bit=*/true);
  const int64_t num_tokens = k.size(0);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " is out of range");
  }

  const bool is_narrowed = k.scalar_type() != k_cache.scalar_type();
  VBATCH_DISPATCH_KV_TYPES(k_cache.scalar_type(), "reshape_and_cache_cpu", [&] {
    using cache_t = scalar_t;
    cache_t* k_cache_data = k_cache.mutable_data_ptr<cache_t>();
    cache_t* v_cache_data = v_cache.mutable_data_ptr<cache_t>();
    if (is_narrowed) {
      copy_to_cache<float, cache_t>(k, v, k_cache_data, v_cache_data, slots);
    } else {
      copy_to_cache<cache_t, cache_t>(k, v, k_cache_data, v_cache_data, slots);
    }
  });
}

}  // namespace
}  // namespace vbatch

TORCH_LIBRARY_IMPL(vbatch, CPU, m) {
  m.impl("paged_attention", &vbatch::paged_attention_cpu);
  m.impl("reshape_and_cache", &vbatch::reshape_and_cache_cpu);
}
