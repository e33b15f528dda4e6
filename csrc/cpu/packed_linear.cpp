// CPU float32 linear for decode-sized row counts: x [M, K] @ W^T, W packed once into panels.
//
// A panel holds kPanel = 2 * kNumLanes output columns of W as [K][kPanel], so one k step of
// the micro-kernel loads two SIMD vectors of weights and multiplies them into kRowBlock rows'
// accumulators (2 * kRowBlock registers). Each thread walks its own panels in order, which is
// one sequential stream through the weights: at a decode batch every weight is read from
// memory once per call and reused from L1/L2 for every row block, and the next panel is
// prefetched while the first row block of the current one runs. Every output is a plain
// k-ordered FMA chain, so a row's result does not depend on the other rows in the call.
//
// A gated MLP's gate/up projection can be packed for SwiGLU (pack_swiglu_weight): panel p holds
// gate columns [p * kNumLanes, (p + 1) * kNumLanes) in its first half and the same up columns
// in its second, and packed_swiglu writes silu(gate) * up straight from the accumulators: the
// same bits as packed_linear then vbatch::silu_mul, without writing and rereading the [M, 2I]
// gate/up output.
//
// A greedy LM head (packed_head_argmax) runs the same micro-kernel into a per-thread tile and folds
// each tile into lane-wise running maxima at once, so the [M, vocab] logits are never written and
// re-read: each row's argmax comes from the same products as packed_linear's logits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "../vec_math.h"

namespace vbatch {
namespace {

constexpr int64_t kPanel = 2 * kNumLanes;
// NOTE: 2 * kRowBlock accumulators, two weight vectors and one broadcast fit the 16 AVX2 or
// 32 AVX-512 vector registers. On the AVX-512 EPYC (Zen 4), 14 rows ran SmolLM2's four
// projections 7-8% faster than 12 at 512 and 2048 rows and 7% at 64, measured against oneDNN
// in the same process (the same bits: each output stays one k-ordered FMA chain).
#if defined(__AVX512F__)
constexpr int kRowBlock = 14;
#else
constexpr int kRowBlock = 6;
#endif
constexpr int64_t kLine = 64;
// NOTE: the input rows one pass over the panels serves, in bytes: half of a 1 MiB L2,
// leaving room for the panel being read.
constexpr int64_t kRowBlockBytes = 512 * 1024;

// Asks for one row of the next panel into L1 and the same row of the panel after it into L2
// (panel_floats apart; a prefetch never faults, so past the last panel it costs nothing).
// NOTE: the L2 hint one panel further ran the 30 layers' packed projections 11% faster at 16
// rows natively and 9% at one row under -march=haswell, and within 2% elsewhere (1-512 rows,
// 2 interleaved pairs of `benchmarks.march_builds` runs, Intel Xeon of the AMX class).
inline void prefetch_panel_row(const float* p, int64_t panel_floats) {
#if defined(__AVX512F__) || defined(__AVX2__)
  for (int64_t b = 0; b < kPanel * 4; b += kLine) {
    _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T0);
    // NOTE: an address, not a pointer into the weights: past the last panel it is outside them.
    const uintptr_t later = reinterpret_cast<uintptr_t>(p) + panel_floats * 4 + b;
    _mm_prefetch(reinterpret_cast<const char*>(later), _MM_HINT_T1);
  }
#else
  (void)p;
  (void)panel_floats;
#endif
}

// The next panel's rows [first, first + count) that a row block asks for while it reads its own
// K rows, spread evenly over them (panel null: none). A panel's row blocks split the next panel
// in proportion to their rows, so it arrives at the rate the whole panel is computed.
struct Prefetch {
  const float* panel;
  int64_t first;
  int64_t count;
};

// out[r, c] = sum_k x[r, k] * panel[k, c] (+ bias[c]) for r < R, c < cols; with kSwiglu,
// out[r, c] = silu_times(gate, up) of panel columns c and kNumLanes + c, for c < cols.
// NOTE: never inlined: inlined into packed_head_argmax's panel walk, GCC's -march=haswell
// build ran the greedy head 2x slower at 24-64 rows (35.6 against 17.1 ms at 64, 2 threads);
// out of line it is as fast there, and as fast or faster in every other use and on AVX-512.
template <int R, bool kSwiglu>
__attribute__((noinline)) void micro_kernel(const float* x, int64_t ldx, const float* panel,
                                            int64_t K, const float* bias, float* out, int64_t ldo,
                                            int64_t cols, const Prefetch& prefetch) {
  Lanes acc0[R], acc1[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = lanes_zero();
  const float* ahead =
      prefetch.panel == nullptr ? nullptr : prefetch.panel + prefetch.first * kPanel;
  int64_t credit = 0;
  for (int64_t k = 0; k < K; ++k) {
    const Lanes w0 = lanes_load(panel + k * kPanel);
    const Lanes w1 = lanes_load(panel + k * kPanel + kNumLanes);
    credit += prefetch.count;
    if (ahead != nullptr && credit >= K) {
      credit -= K;
      prefetch_panel_row(ahead, K * kPanel);
      ahead += kPanel;
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Lanes a = lanes_set1(x[r * ldx + k]);
      acc0[r] = lanes_fmadd(a, w0, acc0[r]);
      acc1[r] = lanes_fmadd(a, w1, acc1[r]);
    }
  }
  if constexpr (kSwiglu) {
    // NOTE: one vector loop over the whole block, then full-width row stores. A short loop
    // and a memmove call per row made the SwiGLU GEMM 10-13% slower than the plain one at 512
    // and 2048 rows and 24-33% at 64; this form ran it 8-20% faster (Intel Sapphire Rapids
    // class, AVX-512, 1 thread, 3 interleaved rounds against the per-row form).
    alignas(64) float gate[R * kNumLanes], up[R * kNumLanes];
    for (int r = 0; r < R; ++r) {
      Lanes lo = acc0[r], hi = acc1[r];
      if (bias != nullptr) {
        lo = lanes_add(lo, lanes_load(bias));
        hi = lanes_add(hi, lanes_load(bias + kNumLanes));
      }
      lanes_store(gate + r * kNumLanes, lo);
      lanes_store(up + r * kNumLanes, hi);
    }
#pragma omp simd
    for (int64_t i = 0; i < R * kNumLanes; ++i) gate[i] = silu_times(gate[i], up[i]);
    for (int r = 0; r < R; ++r) {
      if (cols == kNumLanes) {
        lanes_store(out + r * ldo, lanes_load(gate + r * kNumLanes));
      } else {
        std::copy(gate + r * kNumLanes, gate + r * kNumLanes + cols, out + r * ldo);
      }
    }
    return;
  }
  alignas(64) float tile[kPanel];
  for (int r = 0; r < R; ++r) {
    Lanes lo = acc0[r], hi = acc1[r];
    if (bias != nullptr) {
      lo = lanes_add(lo, lanes_load(bias));
      hi = lanes_add(hi, lanes_load(bias + kNumLanes));
    }
    float* row = out + r * ldo;
    if (cols == kPanel) {
      lanes_store(row, lo);
      lanes_store(row + kNumLanes, hi);
    } else {
      lanes_store(tile, lo);
      lanes_store(tile + kNumLanes, hi);
      std::copy(tile, tile + cols, row);
    }
  }
}

template <int R, bool kSwiglu>
void rows_tail(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias,
               float* out, int64_t ldo, int64_t cols, const Prefetch& prefetch, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) {
      rows_tail<R - 1, kSwiglu>(x, ldx, panel, K, bias, out, ldo, cols, prefetch, rows);
      return;
    }
  }
  micro_kernel<R, kSwiglu>(x, ldx, panel, K, bias, out, ldo, cols, prefetch);
}

// Packs the rows of `weight` [rows, K] into [panels, K, kPanel]: panel column c of panel p is
// weight row source_row(p, c), or zeros where that is -1.
template <typename F>
at::Tensor pack_panels(const at::Tensor& weight, int64_t panels, F source_row) {
  const at::Tensor w = weight.contiguous();
  const int64_t K = w.size(1);
  at::Tensor packed = at::empty({panels, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* rows[kPanel];
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t row = source_row(p, c);
        rows[c] = row < 0 ? nullptr : src + row * K;
      }
      float* panel = dst + p * K * kPanel;
      for (int64_t k = 0; k < K; ++k) {
        float* line = panel + k * kPanel;
        for (int64_t c = 0; c < kPanel; ++c) line[c] = rows[c] == nullptr ? 0.0f : rows[c][k];
      }
    }
  });
  return packed;
}

// Visits panels [begin, end) of x [M, K]'s rows in blocks whose inputs stay in L2 while the
// panels stream past them (a decode batch is one block, so its weights are read once):
// block(p, panel, m, rows, prefetch) for each micro-kernel's rows from m, panel_at(p) being
// panel p. A block's rows split evenly into as few micro-kernel calls as kRowBlock allows
// (16 rows: 8 + 8, not 14 + 2), as a call of few rows leaves its FMAs waiting on each other's
// latency. A panel's calls split the next panel's prefetch between them (Prefetch).
template <typename PanelAt, typename Block>
void walk_panels(int64_t M, int64_t K, int64_t begin, int64_t end, const PanelAt& panel_at,
                 const Block& block) {
  const int64_t block_rows =
      std::max<int64_t>(kRowBlock, kRowBlockBytes / (K * 4) / kRowBlock * kRowBlock);
  for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
    const int64_t m_end = std::min(M, m0 + block_rows);
    const int64_t calls = (m_end - m0 + kRowBlock - 1) / kRowBlock;
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = panel_at(p);
      const float* next = p + 1 < end ? panel_at(p + 1) : nullptr;
      for (int64_t call = 0; call < calls; ++call) {
        const int64_t m = m0 + (m_end - m0) * call / calls;
        const int64_t rows = m0 + (m_end - m0) * (call + 1) / calls - m;
        const int64_t first = K * (m - m0) / (m_end - m0);
        const int64_t last = K * (m - m0 + rows) / (m_end - m0);
        block(p, panel, m, rows, Prefetch{next, first, last - first});
      }
    }
  }
}

// x [M, K] through the packed panels: out [M, ldo], panel p's columns going to out columns
// p * cols_per_panel on; bias_panels (undefined: none) is laid out as the panels' columns.
template <bool kSwiglu>
at::Tensor run_panels(const at::Tensor& x, const at::Tensor& packed,
                      const at::Tensor& bias_panels, int64_t ldo, int64_t cols_per_panel) {
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty({input.size(0), ldo}, input.options());
  const int64_t M = input.size(0), K = input.size(1), panels = packed.size(0);
  if (M == 0) return out;
  const float* xp = input.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bias_ptr = bias_panels.defined() ? bias_panels.const_data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    const DenormalsFlushed flushed(kSwiglu);
    walk_panels(M, K, begin, end, [&](int64_t p) { return wp + p * K * kPanel; },
                [&](int64_t p, const float* panel, int64_t m, int64_t rows,
                    const Prefetch& prefetch) {
                  const int64_t cols = std::min(cols_per_panel, ldo - p * cols_per_panel);
                  const float* panel_bias = bias_ptr == nullptr ? nullptr : bias_ptr + p * kPanel;
                  rows_tail<kRowBlock, kSwiglu>(xp + m * K, K, panel, K, panel_bias,
                                                op + m * ldo + p * cols_per_panel, ldo, cols,
                                                prefetch, rows);
                });
  });
  return out;
}

// Whether logit v beats the best b so far in torch.argmax's order: larger, or NaN over a number.
inline bool beats(float v, float b) { return v > b || (v != v && b == b); }

// A row's best logit and its vocab column; column -1 before any.
struct Best {
  float value = -std::numeric_limits<float>::infinity();
  int64_t column = -1;
};

// The lane-wise running maxima of rows [0, M) over consecutive panels: lane c of a row holds the
// best logit seen in column c of those panels and the column it came from (the first on ties).
class LaneMaxima {
 public:
  explicit LaneMaxima(int64_t M)
      : value_(M * kPanel, -std::numeric_limits<float>::infinity()), column_(M * kPanel, -1) {}

  // Folds tile [rows, kPanel] (row r of it is row `row0 + r`) into the maxima; columns
  // [col0, col0 + cols) of the vocab, the panel's lanes past `cols` being padding.
  void fold(const float* tile, int64_t row0, int64_t rows, int64_t col0, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* t = tile + r * kPanel;
      float* value = value_.data() + (row0 + r) * kPanel;
      int32_t* column = column_.data() + (row0 + r) * kPanel;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        const bool take = column[c] < 0 || beats(t[c], value[c]);
        value[c] = take ? t[c] : value[c];
        column[c] = take ? static_cast<int32_t>(col0 + c) : column[c];
      }
    }
  }

  // Row r's best over every lane: the largest logit (NaN first), the lowest column on ties.
  Best row(int64_t r) const {
    Best best;
    for (int64_t c = 0; c < kPanel; ++c) {
      const float v = value_[r * kPanel + c];
      const int64_t col = column_[r * kPanel + c];
      if (col < 0) continue;
      const bool ties = v == best.value || (v != v && best.value != best.value);
      if (best.column < 0 || beats(v, best.value) || (ties && col < best.column)) {
        best = Best{v, col};
      }
    }
    return best;
  }

 private:
  std::vector<float> value_;
  std::vector<int32_t> column_;
};

void check_input(const at::Tensor& x, const at::Tensor& packed, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), op,
              ": x must be a 2-D float32 CPU tensor, got ", x.sizes());
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(2) == kPanel && packed.size(1) == x.size(1),
              op, ": packed must come from this build's packing and have ", x.size(1),
              " input features, got ", packed.sizes());
}

// The plain panel column c of panel p: row p * kPanel + c of N rows, or -1 past them.
int64_t plain_row(int64_t p, int64_t c, int64_t N) {
  const int64_t row = p * kPanel + c;
  return row < N ? row : -1;
}

// The SwiGLU panel column c of panel p: gate row p * kNumLanes + c, or up row
// intermediate + p * kNumLanes + c - kNumLanes; -1 past the intermediate size.
int64_t swiglu_row(int64_t p, int64_t c, int64_t intermediate) {
  const int64_t col = p * kNumLanes + c % kNumLanes;
  if (col >= intermediate) return -1;
  return c < kNumLanes ? col : intermediate + col;
}

// `bias` [size] float32 laid out as the panels' columns (zeros where source_row gives -1), or an
// undefined tensor without a bias.
template <typename F>
at::Tensor bias_in_panels(const std::optional<at::Tensor>& bias, int64_t size, int64_t panels,
                          F source_row, const char* op) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == size && bias->scalar_type() == at::kFloat, op,
              ": bias must be float32 [", size, "]");
  at::Tensor out = at::zeros({panels * kPanel}, bias->options());
  const at::Tensor b = bias->contiguous();
  const float* src = b.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t c = 0; c < kPanel; ++c) {
      const int64_t row = source_row(p, c);
      if (row >= 0) dst[p * kPanel + c] = src[row];
    }
  }
  return out;
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_linear_weight: weight must be a 2-D float32 CPU tensor, got ",
              weight.sizes(), " ", weight.scalar_type());
  const int64_t N = weight.size(0);
  return pack_panels(weight, (N + kPanel - 1) / kPanel,
                     [N](int64_t p, int64_t c) { return plain_row(p, c, N); });
}

at::Tensor pack_swiglu_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat &&
                  weight.device().is_cpu() && weight.size(0) % 2 == 0,
              "pack_swiglu_weight: weight must be a 2-D float32 CPU tensor with gate rows then "
              "as many up rows, got ",
              weight.sizes(), " ", weight.scalar_type());
  const int64_t intermediate = weight.size(0) / 2;
  return pack_panels(weight, (intermediate + kNumLanes - 1) / kNumLanes,
                     [intermediate](int64_t p, int64_t c) {
                       return swiglu_row(p, c, intermediate);
                     });
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  check_input(x, packed, "packed_linear");
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kPanel &&
                  out_features <= packed.size(0) * kPanel,
              "packed_linear: out_features ", out_features, " does not match ", packed.size(0),
              " panels");
  const at::Tensor bias_panels = bias_in_panels(
      bias, out_features, packed.size(0),
      [out_features](int64_t p, int64_t c) { return plain_row(p, c, out_features); },
      "packed_linear");
  return run_panels<false>(x, packed, bias_panels, out_features, kPanel);
}

at::Tensor packed_swiglu(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate,
                         const std::optional<at::Tensor>& bias) {
  check_input(x, packed, "packed_swiglu");
  TORCH_CHECK(intermediate > (packed.size(0) - 1) * kNumLanes &&
                  intermediate <= packed.size(0) * kNumLanes,
              "packed_swiglu: intermediate size ", intermediate, " does not match ",
              packed.size(0), " panels");
  const at::Tensor bias_panels = bias_in_panels(
      bias, 2 * intermediate, packed.size(0),
      [intermediate](int64_t p, int64_t c) { return swiglu_row(p, c, intermediate); },
      "packed_swiglu");
  return run_panels<true>(x, packed, bias_panels, intermediate, kNumLanes);
}

// argmax over the vocab of x [M, K] @ W^T per row, as torch.argmax of packed_linear's logits
// (the first maximum; the first NaN where there is one), for an LM head W [out_features, K] in
// chunks of chunk_cols rows, each packed by pack_linear_weight. The threads take contiguous
// panel ranges, whose results are merged in vocab order.
at::Tensor packed_head_argmax(const at::Tensor& x, at::TensorList chunks, int64_t chunk_cols,
                              int64_t out_features) {
  TORCH_CHECK(!chunks.empty() && chunk_cols > 0 && chunk_cols % kPanel == 0,
              "packed_head_argmax: chunk_cols must be a positive multiple of ", kPanel,
              " and chunks non-empty, got ", chunk_cols);
  TORCH_CHECK(out_features > (static_cast<int64_t>(chunks.size()) - 1) * chunk_cols &&
                  out_features <= static_cast<int64_t>(chunks.size()) * chunk_cols,
              "packed_head_argmax: ", chunks.size(), " chunks of ", chunk_cols,
              " columns do not make ", out_features);
  const int64_t chunk_panels = chunk_cols / kPanel;
  std::vector<const float*> panel_base;
  for (size_t i = 0; i < chunks.size(); ++i) {
    check_input(x, chunks[i], "packed_head_argmax");
    const int64_t cols = std::min(chunk_cols, out_features - static_cast<int64_t>(i) * chunk_cols);
    TORCH_CHECK(chunks[i].size(0) == (cols + kPanel - 1) / kPanel, "packed_head_argmax: chunk ",
                i, " must pack ", cols, " columns, got ", chunks[i].sizes());
    panel_base.push_back(chunks[i].const_data_ptr<float>());
  }
  const at::Tensor input = x.contiguous();
  const int64_t M = input.size(0), K = input.size(1);
  at::Tensor out = at::empty({M}, input.options().dtype(at::kLong));
  if (M == 0) return out;
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  const auto panel_at = [&](int64_t g) {
    return panel_base[g / chunk_panels] + (g % chunk_panels) * K * kPanel;
  };
  const float* xp = input.const_data_ptr<float>();
  const int64_t ranges = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), panels));
  std::vector<std::vector<Best>> range_best(ranges);
  at::parallel_for(0, ranges, 1, [&](int64_t range_begin, int64_t range_end) {
    alignas(64) float tile[kRowBlock * kPanel];
    for (int64_t range = range_begin; range < range_end; ++range) {
      LaneMaxima maxima(M);
      walk_panels(M, K, panels * range / ranges, panels * (range + 1) / ranges, panel_at,
                  [&](int64_t p, const float* panel, int64_t m, int64_t rows,
                      const Prefetch& prefetch) {
                    rows_tail<kRowBlock, false>(xp + m * K, K, panel, K, nullptr, tile, kPanel,
                                                kPanel, prefetch, rows);
                    maxima.fold(tile, m, rows, p * kPanel,
                                std::min(kPanel, out_features - p * kPanel));
                  });
      std::vector<Best>& best = range_best[range];
      best.resize(M);
      for (int64_t r = 0; r < M; ++r) best[r] = maxima.row(r);
    }
  });
  int64_t* result = out.mutable_data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) {
    Best best = range_best[0][r];
    for (int64_t range = 1; range < ranges; ++range) {
      const Best& other = range_best[range][r];
      if (other.column >= 0 && (best.column < 0 || beats(other.value, best.value))) best = other;
    }
    result[r] = best.column;
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(vbatch, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias=None) -> Tensor");
  m.def("pack_swiglu_weight(Tensor weight) -> Tensor");
  m.def("packed_swiglu(Tensor x, Tensor packed, int intermediate, Tensor? bias=None) -> Tensor");
  m.def(
      "packed_head_argmax(Tensor x, Tensor[] chunks, int chunk_cols, int out_features) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(vbatch, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
  m.impl("pack_swiglu_weight", &pack_swiglu_weight);
  m.impl("packed_swiglu", &packed_swiglu);
  m.impl("packed_head_argmax", &packed_head_argmax);
}

}  // namespace vbatch
