// int8 rows on the CPU: one call rounds each input row to int8 on a scale of its own, multiplies it with a weight
// of int8 rows and scales the sums back to float32.  The torch reference is Int8Rows in
// fairseq_fastgen/ops/precision_linear.py (fbgemm's and oneDNN's products on the same integers): this kernel gives
// the same bits (tests/ops/test_int8_kernel.py).  Two builds of this one source, chosen by the processor
// (fairseq_fastgen/ops/int8_kernel.py):
//
// * AVX-512 VNNI (-mavx512vnni): vpdpbusd sums four u8 x s8 products into each int32 lane, exactly; inputs in
//   [-127, 127] (FASTGEN_INPUT_LEVELS 127).
// * AVX2 (every other x86 processor torch's int8 runs on): vpmaddubsw multiplies u8 by s8 and sums pairs into
//   int16 lanes, saturating, then vpmaddwd sums those pairs into int32; with inputs in [-63, 63]
//   (FASTGEN_INPUT_LEVELS 63, fbgemm's 7-bit inputs on such processors) a pair stays below 2 * 127 * 127 = 32,258,
//   so nothing saturates and the sums are exact too.
//
// Why a kernel of our own: at one to a few rows a decoder step's products read each weight once, and fbgemm's
// dynamic linear costs ~48 us for a 512 x 512 weight whose 256 KiB take ~13 us to read, plus five torch calls
// around it to round the input.  Here the rounding, the product and the scaling are one call.
//
// The weight's layout (packed once, in torch: int8_kernel.pack_rows): groups of 64 output rows; inside a group,
// for every 4 consecutive inputs k..k+3, the 64 rows' 4 bytes each: (out/64, in/4, 64, 4).  The input's 4 bytes at
// one k4 are broadcast to all lanes; a group's 64 x 4 bytes there are 4 zmm registers (VNNI), or 8 ymm, taken as
// two halves of 32 rows one after the other (AVX2: 16 registers hold no more sums of two rows; a single row takes
// the whole group at once).  Both instructions multiply unsigned by signed bytes, so the input goes in as
// q + kOffset (kLevels + 1) and kOffset * (sum of the weight row) comes off the int32 sum after.
//
// Compiled with -ffp-contract=off: the scaling is float(sum) * weight scale, then * input scale, then + bias,
// each rounded as torch rounds them, never fused into one FMA.

#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#ifndef FASTGEN_INPUT_LEVELS
#error "build with -DFASTGEN_INPUT_LEVELS=127 (AVX-512 VNNI) or 63 (AVX2)"
#endif
#ifndef FASTGEN_PREFETCH_HINT  // where the weights' next lines are prefetched to (int8_kernel.py: the L2 cache)
#error "build with -DFASTGEN_PREFETCH_HINT=_MM_HINT_T1 (fairseq_fastgen/ops/int8_kernel.py's FLAGS)"
#endif
constexpr int64_t kGroup = 64;                          // output rows a group holds
constexpr float kLevels = FASTGEN_INPUT_LEVELS;         // input integers in [-kLevels, kLevels]
constexpr int32_t kOffset = FASTGEN_INPUT_LEVELS + 1;   // added to each input integer: an unsigned byte

// The inputs k..in-1 of a row rounded one at a time (after a build's vector loop), then its padding (q = 0).
inline void round_tail(const float* x, int64_t k, int64_t in, int64_t in_padded, float scale, uint8_t* out) {
  for (; k < in; ++k) out[k] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(x[k] / scale)) + kOffset);
  for (; k < in_padded; ++k) out[k] = kOffset;
}

inline int32_t four_bytes(const uint8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return four;
}

#if defined(__AVX512VNNI__)
static_assert(FASTGEN_INPUT_LEVELS == 127, "the VNNI build takes inputs in [-127, 127]");
constexpr int64_t kRowsAtOnce = 4;  // input rows sharing one pass over a group's weights (4 x 4 accumulators)

// One input row (in floats) -> its scale and in_padded bytes q + kOffset (padding: q = 0).
float round_row(const float* x, int64_t in, int64_t in_padded, uint8_t* out) {
  __m512 largest = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= in; k += 16) largest = _mm512_max_ps(largest, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  float amax = _mm512_reduce_max_ps(largest);
  for (; k < in; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float scale = std::max(amax, 1e-30f) / kLevels;
  const __m512 scales = _mm512_set1_ps(scale);
  const __m512i offset = _mm512_set1_epi32(kOffset);
  k = 0;
  for (; k + 16 <= in; k += 16) {
    // x / scale rounded half to even (torch.round), as integers + kOffset, narrowed to bytes
    __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + k), scales),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i shifted = _mm512_add_epi32(_mm512_cvtps_epi32(q), offset);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtepi32_epi8(shifted));
  }
  round_tail(x, k, in, in_padded, scale, out);
  return scale;
}

// One input row's 4 bytes at step s, broadcast, times a group's 4 weight registers, into its 4 sums.
#define FASTGEN_ROW_SUMS(r)                                                                 \
  if constexpr (kRows > r) {                                                                \
    const __m512i x = _mm512_set1_epi32(four_bytes(inputs + r * in_padded + s * 4));        \
    s##r##0 = _mm512_dpbusd_epi32(s##r##0, x, w0);                                          \
    s##r##1 = _mm512_dpbusd_epi32(s##r##1, x, w1);                                          \
    s##r##2 = _mm512_dpbusd_epi32(s##r##2, x, w2);                                          \
    s##r##3 = _mm512_dpbusd_epi32(s##r##3, x, w3);                                          \
  }

// One input row's 16 int32 sums for the group's outputs first..first+15 -> float32 in out[first..] (only those
// below `width`): the offset taken off, times the weight rows' scales, times the row's scale, plus the bias.
inline void store_sixteen(__m512i sums, int64_t first, int64_t width, const int32_t* offsets,
                          const float* weight_scales, float input_scale, const float* bias, float* out) {
  __m512i exact = _mm512_sub_epi32(sums, _mm512_loadu_si512(offsets + first));
  __m512 value = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_loadu_ps(weight_scales + first));
  value = _mm512_mul_ps(value, _mm512_set1_ps(input_scale));
  const __mmask16 keep = width - first >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (width - first)) - 1);
  if (bias != nullptr) value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(keep, bias + first));
  _mm512_mask_storeu_ps(out + first, keep, value);
}

// Sums of `rows` (1..4) rounded input rows with one group of 64 weight rows, scaled into out[r * ld + 0..63]
// (only the first `width` outputs written: the last group may hang over the weight's end).  The 16 sums are named
// variables, not an array: GCC keeps an array of them in memory or copies it at every step.
template <int kRows>
void group_product(const uint8_t* inputs, int64_t in_padded, const int8_t* group, const int32_t* offsets,
                   const float* weight_scales, const float* input_scales, const float* bias, float* out,
                   int64_t ld, int64_t width) {
  __m512i s00 = _mm512_setzero_si512(), s01 = s00, s02 = s00, s03 = s00, s10 = s00, s11 = s00, s12 = s00, s13 = s00;
  __m512i s20 = s00, s21 = s00, s22 = s00, s23 = s00, s30 = s00, s31 = s00, s32 = s00, s33 = s00;
  const int64_t steps = in_padded / 4;
  for (int64_t s = 0; s < steps; ++s) {
    const int8_t* w = group + s * kGroup * 4;
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kGroup * 4), FASTGEN_PREFETCH_HINT);
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
    const __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
    FASTGEN_ROW_SUMS(0)
    FASTGEN_ROW_SUMS(1)
    FASTGEN_ROW_SUMS(2)
    FASTGEN_ROW_SUMS(3)
  }
  const __m512i sums[4][4] = {{s00, s01, s02, s03}, {s10, s11, s12, s13}, {s20, s21, s22, s23},
                              {s30, s31, s32, s33}};
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < 4 && j * 16 < width; ++j)
      store_sixteen(sums[r][j], j * 16, width, offsets, weight_scales, input_scales[r], bias, out + r * ld);
}

using GroupProduct = void (*)(const uint8_t*, int64_t, const int8_t*, const int32_t*, const float*,
                              const float*, const float*, float*, int64_t, int64_t);
constexpr GroupProduct kGroupProducts[kRowsAtOnce] = {group_product<1>, group_product<2>, group_product<3>,
                                                      group_product<4>};

// Every input row with one group: kRowsAtOnce rows at a time.
void group_rows(const uint8_t* inputs, int64_t rows, int64_t in_padded, const int8_t* group, const int32_t* offsets,
                const float* weight_scales, const float* input_scales, const float* bias, float* out, int64_t ld,
                int64_t width) {
  for (int64_t r = 0; r < rows; r += kRowsAtOnce) {
    const int64_t chunk = std::min(kRowsAtOnce, rows - r);
    kGroupProducts[chunk - 1](inputs + r * in_padded, in_padded, group, offsets, weight_scales, input_scales + r,
                              bias, out + r * ld, ld, width);
  }
}

#if defined(__AMX_INT8__)
// AMX (the VNNI build with -mamx-tile -mamx-int8, where the processor has them), from kTileRowsAtLeast rows on and
// where the inputs are whole tiles of 64: tdpbusd multiplies a tile of 16 input rows x 64 bytes (u8) with a tile of
// 16 weight rows x 64 inputs, taken from the packed layout as it is (16 steps of 4 inputs, 256 bytes apart), into
// 16 x 16 int32 sums: the same exact sums as vpdpbusd (no saturation), 1,024 multiply-adds a cycle against 128.
// Eight tile registers: tmm0-3 the sums of 32 input rows x 32 outputs (a half group), tmm4-5 the two tiles of
// input rows, tmm6-7 the two tiles of weight rows.
constexpr int64_t kTileRowsAtLeast = 16;
constexpr int64_t kTileRows = 16;   // input rows of one tile
constexpr int64_t kTileInputs = 64;  // inputs (bytes) of one tile row
constexpr int64_t kHalf = 32;        // outputs of one block of sums
constexpr int64_t kTileGroups = 16;   // groups a block of rows takes in one go (512 KiB of weights at 512 inputs)

// Linux gives a thread the tile registers' state only once the process asks for it (arch_prctl
// ARCH_REQ_XCOMP_PERM = 0x1023 for XFEATURE_XTILEDATA = 18); where it refuses, the products stay on vpdpbusd.
bool tiles_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Every tile this thread uses is 16 rows x 64 bytes (a thread's configuration lasts until _tile_release).
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = kTileRows;
  }
  _tile_loadconfig(&config);
}

// The sums of 16 or 32 input rows (kTwoTiles) with a half group's 32 weight rows over every input -> sums[32][32].
template <bool kTwoTiles>
void tile_block(const uint8_t* inputs, int64_t in_padded, const int8_t* half, int32_t* sums) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwoTiles) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < in_padded; k += kTileInputs) {
    const int8_t* w = half + k * kGroup;  // step k/4 of the group: 64 rows x 4 bytes each
    _tile_loadd(6, w, kGroup * 4);
    _tile_loadd(7, w + 16 * 4, kGroup * 4);
    _tile_loadd(4, inputs + k, in_padded);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    if constexpr (kTwoTiles) {
      _tile_loadd(5, inputs + kTileRows * in_padded + k, in_padded);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    }
  }
  _tile_stored(0, sums, kHalf * 4);
  _tile_stored(1, sums + 16, kHalf * 4);
  if constexpr (kTwoTiles) {
    _tile_stored(2, sums + kTileRows * kHalf, kHalf * 4);
    _tile_stored(3, sums + kTileRows * kHalf + 16, kHalf * 4);
  }
}

// A block of up to 2 x 16 input rows with one group, through the tiles: inputs holds whole tiles of 16 rows (the
// last one padded); the caller splits the rows into blocks (int8_rows_linear).
void tile_group_rows(const uint8_t* inputs, int64_t rows, int64_t in_padded, const int8_t* group,
                     const int32_t* offsets, const float* weight_scales, const float* input_scales, const float* bias,
                     float* out, int64_t ld, int64_t width) {
  alignas(64) int32_t sums[2 * kTileRows * kHalf];
  for (int64_t half = 0; half < kGroup && half < width; half += kHalf) {
    if (rows > kTileRows) {
      tile_block<true>(inputs, in_padded, group + half * 4, sums);
    } else {
      tile_block<false>(inputs, in_padded, group + half * 4, sums);
    }
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < kHalf && half + j < width; j += 16)
        store_sixteen(_mm512_load_si512(sums + i * kHalf + j), half + j, width, offsets, weight_scales,
                      input_scales[i], bias, out + i * ld);
  }
}
#endif

#else  // AVX2
static_assert(FASTGEN_INPUT_LEVELS <= 63, "the AVX2 build takes inputs in [-63, 63]: larger ones saturate");
constexpr int64_t kHalf = 32;       // output rows of a half group: 4 ymm of 8 int32 sums
constexpr int64_t kRowsAtOnce = 2;  // input rows sharing one pass over a half group (2 x 4 accumulators)

// One input row (in floats) -> its scale and in_padded bytes q + kOffset (padding: q = 0).
float round_row(const float* x, int64_t in, int64_t in_padded, uint8_t* out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 largest = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= in; k += 8) largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, largest);
  float amax = *std::max_element(lanes, lanes + 8);
  for (; k < in; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float scale = std::max(amax, 1e-30f) / kLevels;
  const __m256 scales = _mm256_set1_ps(scale);
  const __m256i offset = _mm256_set1_epi32(kOffset);
  const __m256i byte_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  // x / scale rounded half to even (torch.round), as integers + kOffset
  auto shifted = [&](int64_t at) {
    const __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + at), scales),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_add_epi32(_mm256_cvtps_epi32(q), offset);
  };
  k = 0;
  for (; k + 32 <= in; k += 32) {  // 32 integers in [1, 127] narrowed to bytes; the packs interleave 4-byte lanes
    const __m256i low = _mm256_packs_epi32(shifted(k), shifted(k + 8));
    const __m256i high = _mm256_packs_epi32(shifted(k + 16), shifted(k + 24));
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(low, high), byte_order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), bytes);
  }
  round_tail(x, k, in, in_padded, scale, out);
  return scale;
}

// The sums of 4 products for 8 rows: u8 x s8 pairs into int16, pairs of those into int32 (exact, see the top).
inline __m256i four_products(__m256i x, __m256i w, __m256i ones) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(x, w), ones);
}

// `blocks` int32 sums of 8 outputs each, the first at output `first` of the group, less the offsets, scaled by the
// weight rows' and the input row's scales, plus the bias, into out[first..] (only outputs below `width` written).
inline void store_sums(const __m256i* sums, int blocks, int64_t first, const int32_t* offsets,
                       const float* weight_scales, float input_scale, const float* bias, float* out, int64_t width) {
  const __m256 row_scale = _mm256_set1_ps(input_scale);
  for (int j = 0; j < blocks && first < width; ++j, first += 8) {
    const __m256i offset = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(offsets + first));
    const __m256i exact = _mm256_sub_epi32(sums[j], offset);
    __m256 value = _mm256_mul_ps(_mm256_cvtepi32_ps(exact), _mm256_loadu_ps(weight_scales + first));
    value = _mm256_mul_ps(value, row_scale);
    if (width - first >= 8) {  // AMD's masked loads and stores take tens of cycles: only for the weight's end
      if (bias != nullptr) value = _mm256_add_ps(value, _mm256_loadu_ps(bias + first));
      _mm256_storeu_ps(out + first, value);
      continue;
    }
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(width - first)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    if (bias != nullptr) value = _mm256_add_ps(value, _mm256_maskload_ps(bias + first, keep));
    _mm256_maskstore_ps(out + first, keep, value);
  }
}

#define FASTGEN_ROW_SUMS(r)                                                                 \
  if constexpr (kRows > r) {                                                                \
    const __m256i x = _mm256_set1_epi32(four_bytes(inputs + r * in_padded + s * 4));        \
    s##r##0 = _mm256_add_epi32(s##r##0, four_products(x, w0, ones));                       \
    s##r##1 = _mm256_add_epi32(s##r##1, four_products(x, w1, ones));                       \
    s##r##2 = _mm256_add_epi32(s##r##2, four_products(x, w2, ones));                       \
    s##r##3 = _mm256_add_epi32(s##r##3, four_products(x, w3, ones));                       \
  }

// Sums of `rows` (1..2) rounded input rows with the 32 weight rows of half `half` of a group, scaled into
// out[r * ld + 0..31] (only the first `width` outputs written).  `group`, `offsets`, `weight_scales`, `bias` and
// `out` point at the group's first row.
template <int kRows>
void half_group_product(const uint8_t* inputs, int64_t in_padded, const int8_t* group, int64_t half,
                        const int32_t* offsets, const float* weight_scales, const float* input_scales,
                        const float* bias, float* out, int64_t ld, int64_t width) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s00 = _mm256_setzero_si256(), s01 = s00, s02 = s00, s03 = s00, s10 = s00, s11 = s00, s12 = s00, s13 = s00;
  const int64_t steps = in_padded / 4;
  for (int64_t s = 0; s < steps; ++s) {
    const int8_t* w = group + s * kGroup * 4 + half * kHalf * 4;
    // both lines the half reads
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kGroup * 4), FASTGEN_PREFETCH_HINT);
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kGroup * 4 + 64), FASTGEN_PREFETCH_HINT);
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
    const __m256i w2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64));
    const __m256i w3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 96));
    FASTGEN_ROW_SUMS(0)
    FASTGEN_ROW_SUMS(1)
  }
  const __m256i sums[2][4] = {{s00, s01, s02, s03}, {s10, s11, s12, s13}};
  for (int r = 0; r < kRows; ++r)
    store_sums(sums[r], 4, half * kHalf, offsets, weight_scales, input_scales[r], bias, out + r * ld, width);
}

// Sums of one rounded input row with a whole group of 64 weight rows, scaled into out[0..63]: a single row reads
// the group's weights once, in order (a half group at a time would take every other pair of cache lines).
void group_product_one_row(const uint8_t* input, int64_t in_padded, const int8_t* group, const int32_t* offsets,
                           const float* weight_scales, float input_scale, const float* bias, float* out,
                           int64_t width) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
  const int64_t steps = in_padded / 4;
  for (int64_t s = 0; s < steps; ++s) {
    const int8_t* w = group + s * kGroup * 4;
    const __m256i x = _mm256_set1_epi32(four_bytes(input + s * 4));
    auto weights = [w](int j) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * 32)); };
    s0 = _mm256_add_epi32(s0, four_products(x, weights(0), ones));
    s1 = _mm256_add_epi32(s1, four_products(x, weights(1), ones));
    s2 = _mm256_add_epi32(s2, four_products(x, weights(2), ones));
    s3 = _mm256_add_epi32(s3, four_products(x, weights(3), ones));
    s4 = _mm256_add_epi32(s4, four_products(x, weights(4), ones));
    s5 = _mm256_add_epi32(s5, four_products(x, weights(5), ones));
    s6 = _mm256_add_epi32(s6, four_products(x, weights(6), ones));
    s7 = _mm256_add_epi32(s7, four_products(x, weights(7), ones));
  }
  const __m256i sums[8] = {s0, s1, s2, s3, s4, s5, s6, s7};
  store_sums(sums, 8, 0, offsets, weight_scales, input_scale, bias, out, width);
}

using HalfGroupProduct = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, const int32_t*, const float*,
                                  const float*, const float*, float*, int64_t, int64_t);
constexpr HalfGroupProduct kHalfGroupProducts[kRowsAtOnce] = {half_group_product<1>, half_group_product<2>};

// Every input row with one group: a half group at a time (its weights stay in the level-1 cache while every row
// passes over them), kRowsAtOnce rows at a time; a single row over the whole group at once.
void group_rows(const uint8_t* inputs, int64_t rows, int64_t in_padded, const int8_t* group, const int32_t* offsets,
                const float* weight_scales, const float* input_scales, const float* bias, float* out, int64_t ld,
                int64_t width) {
  if (rows == 1) {
    group_product_one_row(inputs, in_padded, group, offsets, weight_scales, input_scales[0], bias, out, width);
    return;
  }
  for (int64_t half = 0; half * kHalf < width; ++half) {
    for (int64_t r = 0; r < rows; r += kRowsAtOnce) {
      const int64_t chunk = std::min(kRowsAtOnce, rows - r);
      kHalfGroupProducts[chunk - 1](inputs + r * in_padded, in_padded, group, half, offsets, weight_scales,
                                    input_scales + r, bias, out + r * ld, ld, width);
    }
  }
}
#endif

// x (rows, in) float32; packed (out_padded/64, in_padded/4, 64, 4) int8; weight_scales (out_padded,) float32;
// offsets (out_padded,) int32 = kOffset * the weight rows' sums; bias (out,) float32 or none -> (rows, out) float32.
at::Tensor int8_rows_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight_scales,
                            const at::Tensor& offsets, int64_t out_features, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_rows_linear: x must be (rows, in) float32");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.size(2) == kGroup &&
                  packed.size(3) == 4, "int8_rows_linear: packed must be (groups, in/4, 64, 4) int8");
  const at::Tensor input = x.contiguous();
  const int64_t rows = input.size(0), in = input.size(1), groups = packed.size(0), in_padded = packed.size(1) * 4;
  TORCH_CHECK(in <= in_padded && in_padded - in < 4, "int8_rows_linear: x has ", in, " inputs, the weight ",
              in_padded);
  TORCH_CHECK(out_features <= groups * kGroup && weight_scales.numel() == groups * kGroup &&
                  offsets.numel() == groups * kGroup, "int8_rows_linear: scales or offsets do not match");
  at::Tensor out = at::empty({rows, out_features}, input.options());
  if (rows == 0) return out;
  const float* bias_data = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "int8_rows_linear: bias must be (out,) float32");
    bias_data = bias->data_ptr<float>();
  }
#if defined(__AMX_INT8__)
  const bool tiles = rows >= kTileRowsAtLeast && in_padded % kTileInputs == 0 && tiles_permitted();
  const int64_t rows_padded = tiles ? (rows + kTileRows - 1) / kTileRows * kTileRows : rows;  // whole tiles
#else
  const int64_t rows_padded = rows;
#endif
  std::vector<uint8_t> rounded(rows_padded * in_padded, static_cast<uint8_t>(kOffset));
  std::vector<float> input_scales(rows);
  const float* x_data = input.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    input_scales[r] = round_row(x_data + r * in, in, in_padded, rounded.data() + r * in_padded);
  const int8_t* weights = packed.data_ptr<int8_t>();
  const float* scales = weight_scales.data_ptr<float>();
  const int32_t* offset_data = offsets.data_ptr<int32_t>();
  float* out_data = out.data_ptr<float>();
  // a thread takes whole groups; below ~1 MiB of weight the product stays on one thread
  const int64_t grain = std::max<int64_t>(1, (1 << 20) / (kGroup * in_padded));
  at::parallel_for(0, groups, grain, [&](int64_t first, int64_t last) {
    // rows r.. of group g: its output rows (all of them, through vpdpbusd, or a block of rows, through the tiles)
    auto rows_of_group = [&](auto product, int64_t g, int64_t r, int64_t count) {
      product(rounded.data() + r * in_padded, count, in_padded, weights + g * kGroup * in_padded,
              offset_data + g * kGroup, scales + g * kGroup, input_scales.data() + r,
              bias_data == nullptr ? nullptr : bias_data + g * kGroup, out_data + r * out_features + g * kGroup,
              out_features, std::min(kGroup, out_features - g * kGroup));
    };
#if defined(__AMX_INT8__)
    if (tiles) {
      // a few groups at a time (their weights stay in the core's cache) for each block of rows in turn: each row's
      // outputs are written a few kB at once, not 256 bytes in each of many rows far apart
      configure_tiles();
      for (int64_t g0 = first; g0 < last; g0 += kTileGroups)
        for (int64_t r = 0; r < rows; r += 2 * kTileRows)
          for (int64_t g = g0; g < std::min(last, g0 + kTileGroups); ++g)
            rows_of_group(tile_group_rows, g, r, std::min(2 * kTileRows, rows - r));
      _tile_release();
      return;
    }
#endif
    for (int64_t g = first; g < last; ++g) rows_of_group(group_rows, g, 0, rows);
  });
  return out;
}

// Whether products of kTileRowsAtLeast rows or more run on AMX's tiles in this build and process.
bool int8_rows_tiles() {
#if defined(__AMX_INT8__)
  return tiles_permitted();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(fastgen, m) {
  m.def("int8_rows_linear(Tensor x, Tensor packed, Tensor weight_scales, Tensor offsets, int out_features, "
        "Tensor? bias) -> Tensor");
  m.def("int8_rows_tiles() -> bool", &int8_rows_tiles);
}

TORCH_LIBRARY_IMPL(fastgen, CPU, m) { m.impl("int8_rows_linear", &int8_rows_linear); }
