// float32 products of a few rows on the CPU (AVX-512): x (rows, in) times the transpose of a weight (out, in) in
// torch's own layout, plus a bias.  The torch reference is F.linear; the compiled engine's units of a block of
// positions call it (fairseq_fastgen/engine/f32_rows_weights.py), built beside the int8 kernel
// (fairseq_fastgen/ops/int8_kernel.py); the frozen units of one position at 1 to 4 rows call it too.
//
// Why a kernel of our own: blockwise verification at batch 1 multiplies 4 rows (a block of 4 positions) with every
// weight of the decoder.  The products are bound by reading the weights (165 MB at base size), so 4 rows should cost
// what one costs; inductor's C++ GEMM template reads them at about half that rate at 4 rows, and oneDNN's prepacked
// product at about two thirds.  Here each group of 4 weight rows is read once for every input row, and the next
// group is prefetched, so that the loads stay in flight while the sums are formed.
//
// Each output is the same sum in the same order whatever the number of rows and threads: 16 lanes accumulate
// in[k] * w[k] over k = lane, lane + 16, ... (masked past the last whole 16), then the lanes are added by
// _mm512_reduce_add_ps, then the bias.  A row's outputs are therefore bitwise the same alone or among others.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t kGroup = 4;        // weight rows read together: kGroup x kPassRows sums in registers
constexpr int64_t kPassRows = 4;     // input rows per pass over the weight
constexpr int64_t kAhead = 1;        // the group after the one being summed is prefetched (2 or more: slower)
constexpr int64_t kGrainGroups = 64; // groups per thread's share at least (a 512 x 512 weight: 128 groups)

// Sums of ``R`` input rows (``x`` row-major, ``in`` wide) with the ``G`` weight rows at ``w``; out[r * out_stride + g].
template <int R, int G>
inline void group_sums(const float* x, int64_t in, const float* w, const float* prefetched, float* out,
                       int64_t out_stride, const float* bias) {
  __m512 sums[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) sums[r][g] = _mm512_setzero_ps();
  const int64_t whole = in / 16 * 16;
  for (int64_t k = 0; k < whole; k += 16) {
    if (prefetched != nullptr)
      for (int g = 0; g < G; ++g) _mm_prefetch(reinterpret_cast<const char*>(prefetched + g * in + k), _MM_HINT_T0);
    __m512 weights[G];
    for (int g = 0; g < G; ++g) weights[g] = _mm512_loadu_ps(w + g * in + k);
    for (int r = 0; r < R; ++r) {
      const __m512 input = _mm512_loadu_ps(x + r * in + k);
      for (int g = 0; g < G; ++g) sums[r][g] = _mm512_fmadd_ps(weights[g], input, sums[r][g]);
    }
  }
  if (whole < in) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (in - whole)) - 1);
    __m512 weights[G];
    for (int g = 0; g < G; ++g) weights[g] = _mm512_maskz_loadu_ps(mask, w + g * in + whole);
    for (int r = 0; r < R; ++r) {
      const __m512 input = _mm512_maskz_loadu_ps(mask, x + r * in + whole);
      for (int g = 0; g < G; ++g) sums[r][g] = _mm512_fmadd_ps(weights[g], input, sums[r][g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      const float sum = _mm512_reduce_add_ps(sums[r][g]);
      out[r * out_stride + g] = bias == nullptr ? sum : sum + bias[g];
    }
}

// Weight rows [first, last) for ``R`` input rows: whole groups of kGroup, then the rows left one at a time.
template <int R>
void rows_pass(const float* x, int64_t in, const float* w, int64_t out_features, const float* bias, float* out,
               int64_t first, int64_t last) {
  int64_t o = first;
  for (; o + kGroup <= last; o += kGroup) {
    const int64_t ahead = o + kAhead * kGroup;
    const float* prefetched = ahead + kGroup <= last ? w + ahead * in : nullptr;
    group_sums<R, kGroup>(x, in, w + o * in, prefetched, out + o, out_features, bias == nullptr ? nullptr : bias + o);
  }
  for (; o < last; ++o)
    group_sums<R, 1>(x, in, w + o * in, nullptr, out + o, out_features, bias == nullptr ? nullptr : bias + o);
}

using Pass = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t);
constexpr Pass kPasses[kPassRows] = {rows_pass<1>, rows_pass<2>, rows_pass<3>, rows_pass<4>};

at::Tensor f32_rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "f32_rows_linear: x (rows, in) and weight (out, in), got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "f32_rows_linear: float32 only");
  const at::Tensor input = x.contiguous(), rows_weight = weight.contiguous();
  const at::Tensor bias_values = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t rows = input.size(0), in = input.size(1), out_features = rows_weight.size(0);
  at::Tensor out = at::empty({rows, out_features}, input.options());
  if (rows == 0 || out_features == 0) return out;
  const float* x_data = input.data_ptr<float>();
  const float* w_data = rows_weight.data_ptr<float>();
  const float* b_data = bias_values.defined() ? bias_values.data_ptr<float>() : nullptr;
  float* out_data = out.data_ptr<float>();
  const int64_t groups = (out_features + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, kGrainGroups, [&](int64_t first, int64_t last) {
    const int64_t begin = first * kGroup, end = std::min(out_features, last * kGroup);
    for (int64_t r = 0; r < rows; r += kPassRows) {
      const int64_t pass_rows = std::min(kPassRows, rows - r);
      kPasses[pass_rows - 1](x_data + r * in, in, w_data, out_features, b_data, out_data + r * out_features, begin,
                             end);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastgen, m) {
  m.def("f32_rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastgen, CPU, m) { m.impl("f32_rows_linear", &f32_rows_linear); }

#endif  // __AVX512F__
