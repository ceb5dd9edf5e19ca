// Repeated n-gram banning for beam search (fairseq's --no-repeat-ngram-size).
//
// For each hypothesis row, every n-gram that already occurs in the generated
// tokens and whose first n-1 tokens equal the last n-1 generated tokens bans
// its last token: the row's log-probability for that token becomes -inf.
//
// Launch: one block per row, any number of threads (a grid-stride loop inside
// the block covers rows longer than the block), dynamic shared memory of
// (step + 1) * sizeof(int) bytes for the row's generated tokens.
//
// Token ids are stored as int in shared memory (vocabularies are far below
// 2^31). Ids outside [0, vocab_size) are never written.
//
// lprobs is written through an unsigned integer type of the same width as its
// floating point type, storing the bit pattern of -inf; that keeps one code
// path for float32, float16, bfloat16 and float64 without fp16 headers.

template <typename Bits>
__device__ void ban_repeated_ngrams_in_row(
    const long long* __restrict__ tokens,  // (rows, buffer_len), row stride tokens_row_stride
    Bits* __restrict__ lprobs,             // (rows, vocab_size), row stride lprobs_row_stride
    long long tokens_row_stride, long long lprobs_row_stride, int vocab_size, int step,
    int ngram_size, Bits negative_infinity) {
  extern __shared__ int generated[];  // (step + 1,) the row's generated tokens

  const long long* row_tokens = tokens + blockIdx.x * tokens_row_stride;
  Bits* row_lprobs = lprobs + blockIdx.x * lprobs_row_stride;
  const int generated_len = step + 1;

  for (int position = threadIdx.x; position < generated_len; position += blockDim.x) {
    generated[position] = static_cast<int>(row_tokens[position]);
  }
  __syncthreads();

  // The last n-1 generated tokens start here; an n-gram starting at `start`
  // is complete when start + ngram_size <= generated_len.
  const int suffix_start = generated_len - (ngram_size - 1);
  const int start_count = generated_len - ngram_size + 1;
  for (int start = threadIdx.x; start < start_count; start += blockDim.x) {
    bool prefix_matches = true;
    for (int offset = 0; offset < ngram_size - 1 && prefix_matches; ++offset) {
      prefix_matches = generated[start + offset] == generated[suffix_start + offset];
    }
    const int banned_token = generated[start + ngram_size - 1];
    if (prefix_matches && banned_token >= 0 && banned_token < vocab_size) {
      row_lprobs[banned_token] = negative_infinity;
    }
  }
}

// One kernel per lprobs dtype: NAME(tokens, lprobs viewed as BITS, ...).
#define DEFINE_BAN_REPEATED_NGRAMS(NAME, BITS, NEGATIVE_INFINITY_BITS)                         \
  extern "C" __global__ void NAME(const long long* __restrict__ tokens,                         \
                                  BITS* __restrict__ lprobs, long long tokens_row_stride,       \
                                  long long lprobs_row_stride, int vocab_size, int step,        \
                                  int ngram_size) {                                             \
    ban_repeated_ngrams_in_row(tokens, lprobs, tokens_row_stride, lprobs_row_stride,            \
                               vocab_size, step, ngram_size,                                    \
                               static_cast<BITS>(NEGATIVE_INFINITY_BITS));                      \
  }

DEFINE_BAN_REPEATED_NGRAMS(ban_repeated_ngrams_f32, unsigned int, 0xff800000u)
DEFINE_BAN_REPEATED_NGRAMS(ban_repeated_ngrams_f64, unsigned long long, 0xfff0000000000000ull)
DEFINE_BAN_REPEATED_NGRAMS(ban_repeated_ngrams_f16, unsigned short, 0xfc00u)
DEFINE_BAN_REPEATED_NGRAMS(ban_repeated_ngrams_bf16, unsigned short, 0xff80u)
