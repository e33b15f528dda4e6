// Exact int8 x int8 -> int32 GEMM on any x86-64 CPU with AVX2, VNNI or not (int8_gemm.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace vbatch {

// Output columns per panel of a weight packed by pack_int8_weight in this build.
int64_t int8_panel_cols();

// a [M, K] int8 as int8_packed_mm_into takes it: contiguous, zeros past K up to K rounded to 4.
at::Tensor int8_rows_padded(const at::Tensor& a);

// out[r, c - col_begin] = sum_k a[r, k] * w[c, k] for r < M and col_begin <= c < col_end,
// where `packed` is pack_int8_weight(w) for w [N, K] and col_begin is a multiple of
// int8_panel_cols(). `a` is [M, k_padded] (k_padded: K rounded up to 4, zeros past K), every
// value of `w` in [-127, 127] (any int8 in `a`); out has row stride `ldo`. Parallel over
// panels.
void int8_packed_mm_into(const int8_t* a, int64_t M, int64_t k_padded, const int8_t* packed,
                         int64_t N, int64_t col_begin, int64_t col_end, int32_t* out,
                         int64_t ldo);

}  // namespace vbatch
