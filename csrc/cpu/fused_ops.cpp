// CPU kernels for the fused elementwise ops around the GEMMs: RMSNorm (with the residual add),
// rotary embedding in place, and the gated MLP's silu(gate) * up. Float32 math for every dtype.
//
// Each op is one pass over memory instead of the 5-8 separate torch ops (and parallel regions)
// it replaces; rows are split over threads only when a batch is big enough to pay for it.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

#include "../paged_attention.h"
#include "../vec_math.h"

namespace vbatch {
namespace {

// NOTE: below ~64K elements a parallel region costs more than the work it splits.
constexpr int64_t kElementsPerTask = 1 << 16;

int64_t grain_rows(int64_t row_size) { return std::max<int64_t>(1, kElementsPerTask / row_size); }

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": x must be [num_tokens, hidden] with "
              "contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), name,
              ": weight must be a contiguous [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.device() == x.device(), name,
              ": weight must share x's dtype and device");
}

// out = weight * x / rms(x), each row on its own; in may alias out.
template <typename scalar_t>
inline void rms_norm_row(const scalar_t* in, const scalar_t* weight, scalar_t* out,
                         int64_t hidden, float eps) {
  float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t d = 0; d < hidden; ++d) {
    const float v = static_cast<float>(in[d]);
    sum_sq += v * v;
  }
  const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t d = 0; d < hidden; ++d) {
    // NOTE: rounds the normed value to the input dtype before the weight, as transformers does.
    const scalar_t normed = static_cast<scalar_t>(static_cast<float>(in[d]) * inv_rms);
    out[d] = static_cast<scalar_t>(static_cast<float>(weight[d]) * static_cast<float>(normed));
  }
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  at::Tensor out = at::empty({num_tokens, hidden}, x.options());
  VBATCH_DISPATCH_KV_TYPES(x.scalar_type(), "rms_norm_cpu", [&] {
    const scalar_t* x_data = x.const_data_ptr<scalar_t>();
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, num_tokens, grain_rows(hidden), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rms_norm_row(x_data + t * x.stride(0), w, out_data + t * hidden, hidden,
                     static_cast<float>(eps));
      }
    });
  });
  return out;
}

template <typename scalar_t>
void fused_add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                             float eps) {
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  scalar_t* x_data = x.mutable_data_ptr<scalar_t>();
  scalar_t* r_data = residual.mutable_data_ptr<scalar_t>();
  const scalar_t* w = weight.const_data_ptr<scalar_t>();
  at::parallel_for(0, num_tokens, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      scalar_t* x_row = x_data + t * hidden;
      scalar_t* r_row = r_data + t * hidden;
#pragma omp simd
      for (int64_t d = 0; d < hidden; ++d) {
        r_row[d] = static_cast<scalar_t>(static_cast<float>(r_row[d]) +
                                         static_cast<float>(x_row[d]));
      }
      rms_norm_row(r_row, w, x_row, hidden, eps);
    }
  });
}

// residual += x, then x = rms_norm(residual): the pre-norm block boundary in one pass.
void fused_add_rms_norm_cpu(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                            double eps) {
  check_rows(x, weight, "fused_add_rms_norm");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type() && residual.device() == x.device(),
              "fused_add_rms_norm: x and residual must be contiguous, of one shape and dtype");
  VBATCH_DISPATCH_KV_TYPES(x.scalar_type(), "fused_add_rms_norm_cpu", [&] {
    fused_add_rms_norm_impl<scalar_t>(x, residual, weight, static_cast<float>(eps));
  });
}

template <typename scalar_t>
void rotary_embedding_impl(const int64_t* pos, at::Tensor& qk, const at::Tensor& cos,
                           const at::Tensor& sin) {
  const int64_t num_tokens = qk.size(0), num_heads = qk.size(1), half = qk.size(2) / 2;
  const int64_t token_stride = qk.stride(0), head_stride = qk.stride(1);
  scalar_t* data = qk.mutable_data_ptr<scalar_t>();
  const scalar_t* cos_data = cos.const_data_ptr<scalar_t>();
  const scalar_t* sin_data = sin.const_data_ptr<scalar_t>();
  at::parallel_for(0, num_tokens, grain_rows(num_heads * half * 2), [&](int64_t begin,
                                                                        int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* c = cos_data + pos[t] * half;
      const scalar_t* s = sin_data + pos[t] * half;
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* x1 = data + t * token_stride + h * head_stride;
        scalar_t* x2 = x1 + half;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = static_cast<float>(x1[d]), b = static_cast<float>(x2[d]);
          const float cd = static_cast<float>(c[d]), sd = static_cast<float>(s[d]);
          x1[d] = static_cast<scalar_t>(a * cd - b * sd);
          x2[d] = static_cast<scalar_t>(b * cd + a * sd);
        }
      }
    }
  });
}

// Rotates q and k heads in place (rotate-half layout): qk [T, heads, D] may be a strided slice
// of the fused QKV output; cos, sin [max_positions, D / 2]; positions [T] int64.
void rotary_embedding_cpu(const at::Tensor& positions, at::Tensor& qk, const at::Tensor& cos,
                          const at::Tensor& sin) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1, "rotary_embedding: qk must be [T, heads, D] "
              "contiguous in D");
  const int64_t num_tokens = qk.size(0), head_dim = qk.size(2);
  const int64_t half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0, "rotary_embedding: head_dim must be even");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == half &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rotary_embedding: cos and sin must be contiguous [max_positions, head_dim / 2]");
  TORCH_CHECK(cos.scalar_type() == qk.scalar_type() && sin.scalar_type() == qk.scalar_type(),
              "rotary_embedding: cos and sin must share qk's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == num_tokens && positions.is_contiguous(),
              "rotary_embedding: positions must be a contiguous int64 [num_tokens]");
  for (const at::Tensor* t : {&positions, &cos, &sin}) {
    TORCH_CHECK(t->device() == qk.device(), "rotary_embedding: every input must be on qk's device");
  }
  const int64_t max_positions = cos.size(0);
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_positions, "rotary_embedding: position ", pos[t],
                " is out of range");
  }
  VBATCH_DISPATCH_KV_TYPES(qk.scalar_type(), "rotary_embedding_cpu",
                           [&] { rotary_embedding_impl<scalar_t>(pos, qk, cos, sin); });
}

// gelu(x) = x / 2 * (1 + erf(x / sqrt 2)), erf by Abramowitz and Stegun 7.1.26 (absolute error
// below 1.5e-7) on SIMD lanes. For x < 0, 1 + erf is formed directly from the tail, so it does
// not cancel.
#pragma omp declare simd
__attribute__((always_inline)) inline float gelu_erf(float x) {
  const float a = std::fabs(x) * 0.70710678118654752f;
  const float t = 1.0f / (1.0f + 0.3275911f * a);
  const float poly =
      t * (0.254829592f +
           t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  const float tail = poly * fast_exp(-a * a);
  return 0.5f * x * (x < 0.0f ? tail : 2.0f - tail);
}

void gelu_erf_cpu(at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gelu_erf_: x must be a contiguous float32 tensor");
  float* data = x.mutable_data_ptr<float>();
  at::parallel_for(0, x.numel(), kElementsPerTask, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) data[i] = gelu_erf(data[i]);
  });
}

// silu(gate) * up in one pass: each output element reads its gate and up values once, where
// torch's silu then mul reads the gate twice and writes an intermediate the size of the output.
// gate and up are [rows, cols] with contiguous rows (the two halves of a fused gate/up output).
template <typename scalar_t>
void silu_mul_impl(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  const int64_t rows = gate.size(0), cols = gate.size(1);
  const scalar_t* g = gate.const_data_ptr<scalar_t>();
  const scalar_t* u = up.const_data_ptr<scalar_t>();
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  const int64_t g_stride = gate.stride(0), u_stride = up.stride(0);
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    const DenormalsFlushed flushed;
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g_row = g + r * g_stride;
      const scalar_t* u_row = u + r * u_stride;
      scalar_t* o_row = o + r * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        o_row[c] = static_cast<scalar_t>(
            silu_times(static_cast<float>(g_row[c]), static_cast<float>(u_row[c])));
      }
    }
  });
}

at::Tensor silu_mul_cpu(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 &&
                  up.stride(1) == 1,
              "silu_mul: gate and up must be [rows, cols] of one shape with contiguous rows, got ",
              gate.sizes(), " and ", up.sizes());
  TORCH_CHECK(gate.scalar_type() == up.scalar_type() && gate.device() == up.device(),
              "silu_mul: gate and up must share a dtype and device");
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  VBATCH_DISPATCH_KV_TYPES(gate.scalar_type(), "silu_mul_cpu",
                           [&] { silu_mul_impl<scalar_t>(gate, up, out); });
  return out;
}

}  // namespace
}  // namespace vbatch

TORCH_LIBRARY_IMPL(vbatch, CPU, m) {
  m.impl("gelu_erf_", &vbatch::gelu_erf_cpu);
  m.impl("silu_mul", &vbatch::silu_mul_cpu);
  m.impl("rms_norm", &vbatch::rms_norm_cpu);
  m.impl("fused_add_rms_norm", &vbatch::fused_add_rms_norm_cpu);
  m.impl("rotary_embedding", &vbatch::rotary_embedding_cpu);
}
