// float32 products of a few rows on the CPU (AVX2 with FMA, which every AVX-512 processor has): x (rows, in) times
// the transpose of a weight (out, in), plus a bias.  The torch reference is F.linear; the compiled engine's units of a
// block of positions call it (fairseq_fastgen/engine/f32_rows_weights.py), built beside the int8 kernel
// (fairseq_fastgen/ops/int8_kernel.py); the frozen units of one position at 1 to 4 rows call it too.
//
// Why a kernel of our own: blockwise verification at batch 1 multiplies 4 rows (a block of 4 positions) with every
// weight of the decoder.  The products are bound by reading the weights (165 MB at base size), so 4 rows should cost
// what one costs; inductor's C++ GEMM template reads them at about half that rate at 4 rows, and oneDNN's prepacked
// product at about two thirds.  Here each group of weights is read once for every input row, so that the loads stay
// in flight while the sums are formed.
//
// f32_rows_pack(weight) gives the layout the kernel reads, once per weight: a copy in blocks of 8 outputs,
// (ceil(out / 8), in, 8), which streams from memory in order.  On an AMD Zen 3 that read 1.5x the rate of reading 4
// weight rows side by side; on an AMD Zen 5 (AVX-512) a base decoder step's products at one row took 6.6-6.8 ms
// against 11.3 for an AVX-512 build that read the weight in place, 4 rows side by side, and 12.8 for oneDNN's packed
// product (4 rows: 8.2-8.6 against 13.7 and 9.5), so both builds run these passes.
//
// Up to 8 rows (a block of 8 positions, 2 sentences' blocks of 4) read the weights once, as one row does: 8 rows of
// a base decoder step's products took 7.5-8.0 ms on an AMD Zen 5 (1.1-1.2x one row) against 14.9-16.1 in the passes
// of many rows below.
// More than 8 rows: passes of up to 6 rows by 16 outputs, 12 sums in registers, over the weights of 256 outputs at a
// time, so that every pass after the first reads them from the cache: a batch's or a beam search's products, faster
// than torch's (MKL's sgemm) on an AMD Zen 3 and as fast as oneDNN's on a Zen 5 (the compiled engine's
// --compiled-many-rows kernel, fairseq_fastgen/ops/f32_rows_linear.py).
//
// Each output is the same sum in the same order whatever the number of rows and threads, so a row's outputs are
// bitwise the same alone or among others: each output is one lane, summing in[k] * w[k] over k in order, then the
// bias.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#define FASTGEN_F32_ROWS 1  // a build that holds the kernel
#endif

#if defined(FASTGEN_F32_ROWS)
#include <immintrin.h>

// where the weights' next lines are prefetched to: the build's -DFASTGEN_PREFETCH_HINT (int8_kernel.py: the L2 cache)
#ifndef FASTGEN_PREFETCH_HINT
#error "build with -DFASTGEN_PREFETCH_HINT=_MM_HINT_T1 (fairseq_fastgen/ops/int8_kernel.py's FLAGS)"
#endif

namespace {

void check_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "f32_rows_pack: a weight (out, in), got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "f32_rows_pack: float32 only");
}

void check_inputs(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "f32_rows_linear: float32 only");
}

constexpr int64_t kLanes = 8;       // outputs of a block of the packed layout: one AVX2 register
constexpr int64_t kPassRows = 8;    // input rows of the one pass over the weight of a few rows
constexpr int64_t kGrainBlocks = 32;  // blocks per thread's share at least (a 512 x 512 weight: 64 blocks)

// blocks of outputs summed together for R input rows: R x B sums, B weights and a broadcast input in the 16 registers
template <int R>
constexpr int64_t blocks_for() { return R <= 2 ? 4 : R <= 4 ? 3 : R <= 6 ? 2 : 1; }

// out[lane] = sum[lane] + bias[lane] for the first ``count`` lanes (8, but at the weight's end)
inline void store_block(__m256 sum, float* out, const float* bias, int64_t count) {
  if (count >= kLanes) {
    _mm256_storeu_ps(out, bias == nullptr ? sum : _mm256_add_ps(sum, _mm256_loadu_ps(bias)));
    return;
  }
  // the weight's last block: plain stores of its valid outputs (AMD's masked stores are slow)
  alignas(32) float tail[kLanes];
  _mm256_store_ps(tail, sum);
  for (int64_t j = 0; j < count; ++j) out[j] = bias == nullptr ? tail[j] : tail[j] + bias[j];
}

// out[r * out_stride + b * 8 + lane] = sums[r][b][lane] + bias[b * 8 + lane] for the first ``valid`` outputs of the
// blocks; always inlined, so that the sums stay in registers while they are formed (a call taking the array kept
// gcc 12 storing them to the stack at every product: 43 GFLOP/s at 64 rows against 87-90)
template <int R, int B>
__attribute__((always_inline)) inline void store_sums(const __m256 (&sums)[R][B], float* out, int64_t out_stride,
                                                      const float* bias, int64_t valid) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b)
      store_block(sums[r][b], out + r * out_stride + b * kLanes, bias == nullptr ? nullptr : bias + b * kLanes,
                  valid - b * kLanes);
}

// Sums of ``R`` input rows (``x`` row-major, ``in`` wide) with the ``B`` blocks at ``w`` (each (in, 8));
// out[r * out_stride + b * 8 + lane] for the first ``valid`` outputs of the blocks (the rest is the padding's).
template <int R, int B>
inline void block_sums(const float* x, int64_t in, const float* w, const float* prefetched, float* out,
                       int64_t out_stride, const float* bias, int64_t valid) {
  __m256 sums[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) sums[r][b] = _mm256_setzero_ps();
  auto add_products = [&](int64_t k) {  // in[k] * w[k] for every row and block
    __m256 weights[B];
    for (int b = 0; b < B; ++b) weights[b] = _mm256_loadu_ps(w + (b * in + k) * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m256 input = _mm256_broadcast_ss(x + r * in + k);
      for (int b = 0; b < B; ++b) sums[r][b] = _mm256_fmadd_ps(weights[b], input, sums[r][b]);
    }
  };
  int64_t k = 0;
  for (; k + 2 <= in; k += 2) {  // a 64-byte line of a block holds two k's
    if (prefetched != nullptr)
      for (int b = 0; b < B; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(prefetched + (b * in + k) * kLanes), FASTGEN_PREFETCH_HINT);
    add_products(k);
    add_products(k + 1);
  }
  if (k < in) add_products(k);
  store_sums<R, B>(sums, out, out_stride, bias, valid);
}

// block_sums's sums for the passes of many rows, whose blocks come from the cache after the first pass: no
// prefetch, and each sum in a register from its first product to its store (with block_sums' lambda gcc 12 kept
// storing them to the stack)
template <int R, int B>
inline void tile_sums(const float* x, int64_t in, const float* w, float* out, int64_t out_stride, const float* bias,
                      int64_t valid) {
  __m256 sums[R][B];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) sums[r][b] = _mm256_setzero_ps();
  for (int64_t k = 0; k < in; ++k) {
    __m256 weights[B];
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) weights[b] = _mm256_loadu_ps(w + (b * in + k) * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 input = _mm256_broadcast_ss(x + r * in + k);
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) sums[r][b] = _mm256_fmadd_ps(weights[b], input, sums[r][b]);
    }
  }
  store_sums<R, B>(sums, out, out_stride, bias, valid);
}

// Outputs [begin, end) (begin a whole block's first) for ``R`` input rows: their blocks of the packed weight in whole
// groups of blocks_for<R>(), then one at a time.
template <int R>
void rows_pass(const float* x, int64_t in, const float* w, int64_t out_features, const float* bias, float* out,
               int64_t begin, int64_t end) {
  constexpr int64_t B = blocks_for<R>();
  const int64_t first = begin / kLanes, last = (end + kLanes - 1) / kLanes;
  const int64_t block_floats = in * kLanes;
  int64_t b = first;
  auto sums = [&](auto blocks, int64_t at, const float* prefetched) {
    constexpr int64_t count = decltype(blocks)::value;
    block_sums<R, count>(x, in, w + at * block_floats, prefetched, out + at * kLanes, out_features,
                         bias == nullptr ? nullptr : bias + at * kLanes, out_features - at * kLanes);
  };
  for (; b + B <= last; b += B)
    sums(std::integral_constant<int64_t, B>(), b, b + 2 * B <= last ? w + (b + B) * block_floats : nullptr);
  for (; b < last; ++b) sums(std::integral_constant<int64_t, 1>(), b, nullptr);
}

// rows_pass for the rows of many: tile_sums over 2 blocks at a time (R x 2 sums, 2 weights and an input in registers)
template <int R>
void tile_pass(const float* x, int64_t in, const float* w, int64_t out_features, const float* bias, float* out,
               int64_t begin, int64_t end) {
  const int64_t first = begin / kLanes, last = (end + kLanes - 1) / kLanes;
  const int64_t block_floats = in * kLanes;
  int64_t b = first;
  for (; b + 2 <= last; b += 2)
    tile_sums<R, 2>(x, in, w + b * block_floats, out + b * kLanes, out_features,
                    bias == nullptr ? nullptr : bias + b * kLanes, out_features - b * kLanes);
  if (b < last)
    tile_sums<R, 1>(x, in, w + b * block_floats, out + b * kLanes, out_features,
                    bias == nullptr ? nullptr : bias + b * kLanes, out_features - b * kLanes);
}

using Pass = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t);
constexpr Pass kPasses[kPassRows] = {rows_pass<1>, rows_pass<2>, rows_pass<3>, rows_pass<4>,
                                     rows_pass<5>, rows_pass<6>, rows_pass<7>, rows_pass<8>};

at::Tensor f32_rows_pack(const at::Tensor& weight) {
  check_weight(weight);
  const int64_t out_features = weight.size(0), in = weight.size(1);
  const int64_t blocks = (out_features + kLanes - 1) / kLanes;
  at::Tensor padded = at::zeros({blocks * kLanes, in}, weight.options());
  padded.narrow(0, 0, out_features).copy_(weight);
  return padded.view({blocks, kLanes, in}).transpose(1, 2).contiguous();  // (blocks, in, 8)
}

void check_layout(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kLanes && x.size(1) == packed.size(1)
                  && packed.size(0) == (out_features + kLanes - 1) / kLanes,
              "f32_rows_linear: x (rows, in) and f32_rows_pack's weight (out / 8, in, 8), got ", x.sizes(), " and ",
              packed.sizes(), " for ", out_features, " outputs");
}

constexpr int64_t kShareUnit = kLanes;  // a thread's share of the outputs is whole blocks
// many rows: the passes of up to 6 rows take the weights of 256 outputs in turn (512 KB at 512 inputs, the L2 cache
// of a Zen 3 core); 32, 64, 128 and 512 outputs ran a base decoder step's products at 64 rows 1-13% slower
constexpr int64_t kChunkOutputs = 256;
constexpr int64_t kManyPassRows = 6;
constexpr Pass kManyPasses[kManyPassRows] = {tile_pass<1>, tile_pass<2>, tile_pass<3>,
                                             tile_pass<4>, tile_pass<5>, tile_pass<6>};

// x (rows, in) times the weight in f32_rows_pack's layout: the outputs shared among the threads in whole units of
// kShareUnit, each share's rows in passes of up to kPassRows
at::Tensor f32_rows_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t out_features) {
  check_layout(x, packed, out_features);
  check_inputs(x, packed);
  const at::Tensor input = x.contiguous(), weight = packed.contiguous();
  const at::Tensor bias_values = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t rows = input.size(0), in = input.size(1);
  at::Tensor out = at::empty({rows, out_features}, input.options());
  if (rows == 0 || out_features == 0) return out;
  const float* x_data = input.data_ptr<float>();
  const float* w_data = weight.data_ptr<float>();
  const float* b_data = bias_values.defined() ? bias_values.data_ptr<float>() : nullptr;
  float* out_data = out.data_ptr<float>();
  const int64_t units = (out_features + kShareUnit - 1) / kShareUnit;
  at::parallel_for(0, units, kGrainBlocks, [&](int64_t first, int64_t last) {
    const int64_t begin = first * kShareUnit, end = std::min(out_features, last * kShareUnit);
    // more rows than a pass holds: the passes of many rows, all of them over a few outputs' weights in turn,
    // which stay in the cache for the passes after the first
    const bool many = rows > kPassRows;
    const int64_t chunk = many ? kChunkOutputs : end - begin, pass_limit = many ? kManyPassRows : kPassRows;
    const Pass* passes = many ? kManyPasses : kPasses;
    for (int64_t chunk_begin = begin; chunk_begin < end; chunk_begin += chunk) {
      const int64_t chunk_end = std::min(end, chunk_begin + chunk);
      for (int64_t r = 0; r < rows; r += pass_limit) {
        const int64_t pass_rows = std::min(pass_limit, rows - r);
        passes[pass_rows - 1](x_data + r * in, in, w_data, out_features, b_data, out_data + r * out_features,
                               chunk_begin, chunk_end);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastgen, m) {
  m.def("f32_rows_pack(Tensor weight) -> Tensor");
  m.def("f32_rows_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastgen, CPU, m) {
  m.impl("f32_rows_pack", &f32_rows_pack);
  m.impl("f32_rows_linear", &f32_rows_linear);
}
#endif
