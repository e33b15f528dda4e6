// CUDA kernels for vbatch::paged_attention and vbatch::reshape_and_cache.
//
// Attention runs one thread block per (token, head). Each warp takes kRowsPerStep consecutive
// context positions at a time, every kNumWarps * kRowsPerStep-th, and reads their K/V rows
// through the block table (lanes split head_dim, so loads are coalesced) with all of the step's
// loads in flight at once, then folds the step into an online softmax kept in registers; the
// warps merge their partial (max, sum, acc) states through shared memory at the end. A sliding
// window (> 0) starts the walk at the query's window; a soft cap (> 0) maps each scaled score s
// to cap * tanh(s / cap).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../paged_attention.h"

namespace vbatch {
namespace {

constexpr int kWarpSize = 32;
constexpr int kNumWarps = 4;
constexpr int kNumThreads = kWarpSize * kNumWarps;
constexpr int kMaxHeadDim = 256;
constexpr int kDimsPerLane = kMaxHeadDim / kWarpSize;
// NOTE: one position per warp at a time left the kernel bound by the latency of its dependent
// loads (block table, then K, then a reduction) at over 30x its memory time on an H200.
constexpr int kRowsPerStep = 8;
constexpr int kCacheThreads = 256;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

// The sequence owning a token: the last one whose first query row is at or before it.
__device__ __forceinline__ int find_seq(const int32_t* query_start_loc, int num_seqs, int token) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (query_start_loc[mid] <= token) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kNumThreads) paged_attention_kernel(
    scalar_t* __restrict__ out, const scalar_t* __restrict__ q,
    const scalar_t* __restrict__ k_cache, const scalar_t* __restrict__ v_cache,
    const int32_t* __restrict__ query_start_loc, const int32_t* __restrict__ seq_lens,
    const int32_t* __restrict__ block_tables, int num_seqs, int max_num_blocks, int num_heads,
    int num_kv_heads, int head_dim, int block_size, int64_t q_token_stride,
    int64_t q_head_stride, float scale, int sliding_window, float softcap) {
  __shared__ float q_s[kMaxHeadDim];
  __shared__ float acc_s[kNumWarps][kMaxHeadDim];
  __shared__ float max_s[kNumWarps];
  __shared__ float sum_s[kNumWarps];

  const int token = blockIdx.x, head = blockIdx.y;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int seq = find_seq(query_start_loc, num_seqs, token);
  const int query_len = query_start_loc[seq + 1] - query_start_loc[seq];
  const int context_len = seq_lens[seq] - query_len + (token - query_start_loc[seq]) + 1;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int32_t* block_table = block_tables + static_cast<int64_t>(seq) * max_num_blocks;
  const int64_t row_stride = static_cast<int64_t>(num_kv_heads) * head_dim;

  const scalar_t* q_row = q + token * q_token_stride + head * q_head_stride;
  for (int d = threadIdx.x; d < head_dim; d += kNumThreads) {
    q_s[d] = static_cast<float>(q_row[d]) * scale;
  }
  __syncthreads();

  float q_reg[kDimsPerLane];
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) {
    const int d = lane + i * kWarpSize;
    q_reg[i] = d < head_dim ? q_s[d] : 0.0f;
  }
  float running_max = -INFINITY, running_sum = 0.0f;
  float acc[kDimsPerLane];
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) acc[i] = 0.0f;

  // NOTE: transformers' sliding window: key k is seen from query q when q - window < k <= q.
  const int first_pos = sliding_window > 0 ? max(0, context_len - sliding_window) : 0;
  // NOTE: a step's first position is always in the context, so its max is finite; positions past
  // the context read the last row again (in bounds, so every load can be issued at once) and
  // score -inf, which weighs them 0.
  for (int base = first_pos + warp * kRowsPerStep; base < context_len;
       base += kNumWarps * kRowsPerStep) {
    int64_t rows[kRowsPerStep];
#pragma unroll
    for (int u = 0; u < kRowsPerStep; ++u) {
      const int pos = min(base + u, context_len - 1);
      const int64_t slot =
          static_cast<int64_t>(block_table[pos / block_size]) * block_size + pos % block_size;
      rows[u] = slot * row_stride + static_cast<int64_t>(kv_head) * head_dim;
    }
    float scores[kRowsPerStep];
#pragma unroll
    for (int u = 0; u < kRowsPerStep; ++u) {
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) {
        const int d = lane + i * kWarpSize;
        if (d < head_dim) dot += q_reg[i] * static_cast<float>(k_cache[rows[u] + d]);
      }
      scores[u] = dot;
    }
    float step_max = -INFINITY;
#pragma unroll
    for (int u = 0; u < kRowsPerStep; ++u) {
      float score = warp_sum(scores[u]);
      if (softcap > 0.0f) score = softcap * tanhf(score / softcap);
      scores[u] = base + u < context_len ? score : -INFINITY;
      step_max = fmaxf(step_max, scores[u]);
    }
    const float new_max = fmaxf(running_max, step_max);
    const float correction = expf(running_max - new_max);
    running_max = new_max;
    running_sum *= correction;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) acc[i] *= correction;
#pragma unroll
    for (int u = 0; u < kRowsPerStep; ++u) {
      const float p = expf(scores[u] - new_max);
      running_sum += p;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) {
        const int d = lane + i * kWarpSize;
        if (d < head_dim) acc[i] += p * static_cast<float>(v_cache[rows[u] + d]);
      }
    }
  }

  if (lane == 0) {
    max_s[warp] = running_max;
    sum_s[warp] = running_sum;
  }
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) {
    const int d = lane + i * kWarpSize;
    if (d < head_dim) acc_s[warp][d] = acc[i];
  }
  __syncthreads();

  // NOTE: a warp that saw no positions has max -inf, so its weight below is exp(-inf) = 0.
  float global_max = -INFINITY;
#pragma unroll
  for (int w = 0; w < kNumWarps; ++w) global_max = fmaxf(global_max, max_s[w]);
  float weights[kNumWarps];
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kNumWarps; ++w) {
    weights[w] = expf(max_s[w] - global_max);
    total += sum_s[w] * weights[w];
  }
  scalar_t* out_row = out + (static_cast<int64_t>(token) * num_heads + head) * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += kNumThreads) {
    float value = 0.0f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) value += acc_s[w][d] * weights[w];
    out_row[d] = static_cast<scalar_t>(value / total);
  }
}

// NOTE: a negative slot marks a padding token and is skipped.
template <typename scalar_t>
__global__ void reshape_and_cache_kernel(const scalar_t* __restrict__ k,
                                         const scalar_t* __restrict__ v,
                                         scalar_t* __restrict__ k_cache,
                                         scalar_t* __restrict__ v_cache,
                                         const int64_t* __restrict__ slot_mapping,
                                         int num_kv_heads, int head_dim, int64_t k_token_stride,
                                         int64_t k_head_stride, int64_t v_token_stride,
                                         int64_t v_head_stride) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;
  for (int i = threadIdx.x; i < num_kv_heads * head_dim; i += blockDim.x) {
    const int h = i / head_dim, d = i % head_dim;
    const int64_t dst = (slot * num_kv_heads + h) * head_dim + d;
    k_cache[dst] = k[token * k_token_stride + h * k_head_stride + d];
    v_cache[dst] = v[token * v_token_stride + h * v_head_stride + d];
  }
}

at::Tensor paged_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& query_start_loc,
                                const at::Tensor& seq_lens, const at::Tensor& block_tables,
                                double scale, int64_t sliding_window, double softcap,
                                const std::optional<at::Tensor>& /*prompt_chunks*/) {
  // NOTE: every query row attends alone here, prompt row or not, so prompt_chunks changes nothing.
  check_paged_attention_args(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables);
  TORCH_CHECK(sliding_window >= 0 && sliding_window <= INT32_MAX && softcap >= 0.0,
              "sliding_window and softcap must be >= 0 (0: off)");
  TORCH_CHECK(q.size(2) <= kMaxHeadDim, "head_dim above ", kMaxHeadDim, " is not supported");
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.numel() == 0) return out;
  const dim3 grid(q.size(0), q.size(1));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  VBATCH_DISPATCH_KV_TYPES(q.scalar_type(), "paged_attention_cuda", [&] {
    paged_attention_kernel<scalar_t><<<grid, kNumThreads, 0, stream>>>(
        out.mutable_data_ptr<scalar_t>(), q.const_data_ptr<scalar_t>(),
        k_cache.const_data_ptr<scalar_t>(), v_cache.const_data_ptr<scalar_t>(),
        query_start_loc.const_data_ptr<int32_t>(), seq_lens.const_data_ptr<int32_t>(),
        block_tables.const_data_ptr<int32_t>(), seq_lens.size(0), block_tables.size(1),
        q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), q.stride(0), q.stride(1),
        static_cast<float>(scale), static_cast<int>(sliding_window), static_cast<float>(softcap));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

void reshape_and_cache_cuda(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                            at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_reshape_and_cache_args(k, v, k_cache, v_cache, slot_mapping);
  if (k.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(k.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  VBATCH_DISPATCH_KV_TYPES(k.scalar_type(), "reshape_and_cache_cuda", [&] {
    reshape_and_cache_kernel<scalar_t><<<k.size(0), kCacheThreads, 0, stream>>>(
        k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
        k_cache.mutable_data_ptr<scalar_t>(), v_cache.mutable_data_ptr<scalar_t>(),
        slot_mapping.const_data_ptr<int64_t>(), k.size(1), k.size(2), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace vbatch

TORCH_LIBRARY_IMPL(vbatch, CUDA, m) {
  m.impl("paged_attention", &vbatch::paged_attention_cuda);
  m.impl("reshape_and_cache", &vbatch::reshape_and_cache_cuda);
}
