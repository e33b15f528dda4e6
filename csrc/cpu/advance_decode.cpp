// advance_decode: moves a kept decode batch on by one token per sequence, in place.
//
// Between two decode steps of the same sequences, each row's input id becomes the token it just
// sampled, its position and context length grow by one, and its KV slot is read from its block
// table. One call replaces the three or four numpy/torch calls it would otherwise take; each of
// those costs ~15 us right after a CPU forward pass has swept the caches.
#include <torch/library.h>

namespace vbatch {
namespace {

void check_vector(const at::Tensor& t, int64_t n, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.is_contiguous(), "advance_decode: ", name,
              " must be a contiguous [num_seqs] tensor");
  TORCH_CHECK(t.scalar_type() == dtype, "advance_decode: ", name, " has the wrong dtype");
  TORCH_CHECK(t.device().is_cpu(), "advance_decode: ", name, " must be on the CPU");
}

void advance_decode_cpu(at::Tensor& input_ids, at::Tensor& positions, at::Tensor& slot_mapping,
                        at::Tensor& seq_lens, const at::Tensor& token_ids,
                        const at::Tensor& block_tables, int64_t block_size) {
  const int64_t n = token_ids.numel();
  check_vector(input_ids, n, at::kLong, "input_ids");
  check_vector(positions, n, at::kLong, "positions");
  check_vector(slot_mapping, n, at::kLong, "slot_mapping");
  check_vector(seq_lens, n, at::kInt, "seq_lens");
  check_vector(token_ids, n, at::kLong, "token_ids");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == n &&
                  block_tables.stride(1) == 1 && block_tables.scalar_type() == at::kInt &&
                  block_tables.device().is_cpu(),
              "advance_decode: block_tables must be [num_seqs, max_num_blocks] int32 on the CPU "
              "with contiguous rows");
  TORCH_CHECK(block_size > 0, "advance_decode: block_size must be positive");
  int64_t* ids = input_ids.data_ptr<int64_t>();
  int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* slots = slot_mapping.data_ptr<int64_t>();
  int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* tokens = token_ids.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int64_t max_num_blocks = block_tables.size(1);
  // NOTE: checked before any write, so a failed call leaves the batch as it was.
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(pos[i] >= 0 && (pos[i] + 1) / block_size < max_num_blocks,
                "advance_decode: row ", i, "'s next position ", pos[i] + 1,
                " lies past its block table");
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = pos[i] + 1;
    ids[i] = tokens[i];
    pos[i] = p;
    slots[i] = static_cast<int64_t>(tables[i * table_stride + p / block_size]) * block_size +
               p % block_size;
    lens[i] = static_cast<int32_t>(p + 1);
  }
}

}  // namespace
}  // namespace vbatch

TORCH_LIBRARY_FRAGMENT(vbatch, m) {
  m.def(
      "advance_decode(Tensor(a!) input_ids, Tensor(b!) positions, Tensor(c!) slot_mapping, "
      "Tensor(d!) seq_lens, Tensor token_ids, Tensor block_tables, int block_size) -> ()");
}

TORCH_LIBRARY_IMPL(vbatch, CPU, m) { m.impl("advance_decode", &vbatch::advance_decode_cpu); }
