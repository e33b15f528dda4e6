// Shape, dtype and device checks shared by the CPU and CUDA paged-attention kernels.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

// The cache dtypes the kernels support: float32, bfloat16 and float16 (float32 accumulators).
#define VBATCH_DISPATCH_KV_TYPES(TYPE, NAME, ...)               \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace vbatch {

// Whether activations of dtype `x` may go with a cache of dtype `cache`: the same dtype, or,
// where `can_cache_be_16bit`, float32 activations over a bfloat16 or float16 cache.
inline bool is_cache_dtype_ok(at::ScalarType x, at::ScalarType cache, bool can_cache_be_16bit) {
  return x == cache || (can_cache_be_16bit && x == at::kFloat &&
                        (cache == at::kBFloat16 || cache == at::kHalf));
}

// Checks q [T, H, D], caches [num_blocks, block_size, KVH, D], query_start_loc [S + 1],
// seq_lens [S] and block_tables [S, max_blocks]; every tensor on q's device.
inline void check_paged_attention_args(const at::Tensor& q, const at::Tensor& k_cache,
                                       const at::Tensor& v_cache,
                                       const at::Tensor& query_start_loc,
                                       const at::Tensor& seq_lens,
                                       const at::Tensor& block_tables,
                                       bool can_cache_be_16bit = false) {
  TORCH_CHECK(q.dim() == 3, "q must be [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  is_cache_dtype_ok(q.scalar_type(), k_cache.scalar_type(), can_cache_be_16bit),
              "q, k_cache and v_cache must share a dtype",
              can_cache_be_16bit ? " (or q float32 over a bfloat16/float16 cache)" : "");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q and the caches must share head_dim");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.stride(2) == 1, "q must be contiguous in head_dim");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt,
              "query_start_loc, seq_lens and block_tables must be int32");
  TORCH_CHECK(seq_lens.dim() == 1 && query_start_loc.dim() == 1 &&
                  query_start_loc.size(0) == seq_lens.size(0) + 1,
              "query_start_loc must be [num_seqs + 1] and seq_lens [num_seqs]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == seq_lens.size(0),
              "block_tables must be [num_seqs, max_num_blocks_per_seq]");
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous() &&
                  block_tables.is_contiguous(),
              "query_start_loc, seq_lens and block_tables must be contiguous");
  for (const at::Tensor* t : {&k_cache, &v_cache, &query_start_loc, &seq_lens, &block_tables}) {
    TORCH_CHECK(t->device() == q.device(), "every input must be on q's device");
  }
}

// Checks k, v [T, KVH, D] against caches [num_blocks, block_size, KVH, D] and slot_mapping [T].
inline void check_reshape_and_cache_args(const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& k_cache, const at::Tensor& v_cache,
                                         const at::Tensor& slot_mapping,
                                         bool can_cache_be_16bit = false) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes(),
              "k and v must both be [num_tokens, num_kv_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              "k/v heads and head_dim must match the caches");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type() &&
                  is_cache_dtype_ok(k.scalar_type(), k_cache.scalar_type(), can_cache_be_16bit),
              "k, v and the caches must share a dtype",
              can_cache_be_16bit ? " (or k, v float32 over a bfloat16/float16 cache)" : "");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v must be contiguous in head_dim");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == k.size(0) && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 [num_tokens]");
  for (const at::Tensor* t : {&v, &k_cache, &v_cache, &slot_mapping}) {
    TORCH_CHECK(t->device() == k.device(), "every input must be on k's device");
  }
}

}  // namespace vbatch
