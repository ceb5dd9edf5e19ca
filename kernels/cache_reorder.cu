// In-place row gather for attention caches: row r becomes the old row
// source_rows[r], for r in [0, dest_rows). Used for
//   * the beam reorder of the self-attention K/V cache
//     (dest_rows == rows, source_rows == new_order), and
//   * compacting the per-sentence encoder-decoder cache when sentences finish
//     (dest_rows == kept sentences, source_rows == their old indices).
//
// Scheme: every row is a sequence of row_words words; the launch splits the
// word range into tiles of tile_words and gives each block one tile of EVERY
// row. A block therefore owns the same columns of all rows and no other block
// touches them, so there is no hazard between blocks. Inside a block:
//   1. the source of every moved row (source_rows[r] != r) is copied, for the
//      block's tile, into shared memory;
//   2. __syncthreads(): all reads of the tile are done;
//   3. the staged tiles are written to the moved rows.
// Rows that keep their place are neither read nor written, so an identity
// order moves nothing; each moved row is read once and written once, and the
// only scratch is the staged tile in shared memory. Source indices outside
// [0, rows) leave their destination row unchanged instead of reading out of
// bounds.
//
// Launch: grid = ceil(row_words / tile_words) blocks, any number of threads,
// dynamic shared memory of dest_rows * sizeof(int) + dest_rows * tile_words *
// sizeof(Word) bytes. Word is the widest unsigned type that divides the row
// size in bytes.

template <typename Word>
__device__ void gather_rows_in_place(
    Word* __restrict__ data,                   // (rows, row_words)
    const long long* __restrict__ source_rows,  // (dest_rows,)
    long long row_words, int rows, int dest_rows, int tile_words) {
  extern __shared__ int staged[];  // int (dest_rows,) then Word (dest_rows, tile_words)
  int* source_of = staged;
  Word* staged_tiles = reinterpret_cast<Word*>(staged + dest_rows);

  const long long tile_start = static_cast<long long>(blockIdx.x) * tile_words;
  const long long words_left = row_words - tile_start;
  const int tile_len = words_left < tile_words ? static_cast<int>(words_left) : tile_words;

  for (int row = threadIdx.x; row < dest_rows; row += blockDim.x) {
    const long long source = source_rows[row];
    source_of[row] = (source >= 0 && source < rows) ? static_cast<int>(source) : row;
  }
  __syncthreads();

  const int tile_items = dest_rows * tile_len;
  for (int item = threadIdx.x; item < tile_items; item += blockDim.x) {
    const int row = item / tile_len;
    const int column = item % tile_len;
    if (source_of[row] != row) {
      staged_tiles[item] = data[source_of[row] * row_words + tile_start + column];
    }
  }
  __syncthreads();

  for (int item = threadIdx.x; item < tile_items; item += blockDim.x) {
    const int row = item / tile_len;
    const int column = item % tile_len;
    if (source_of[row] != row) {
      data[row * row_words + tile_start + column] = staged_tiles[item];
    }
  }
}

// One kernel per word width: NAME(data viewed as WORD, source_rows, ...).
#define DEFINE_GATHER_ROWS_IN_PLACE(NAME, WORD)                                                \
  extern "C" __global__ void NAME(WORD* __restrict__ data,                                      \
                                  const long long* __restrict__ source_rows,                    \
                                  long long row_words, int rows, int dest_rows,                 \
                                  int tile_words) {                                             \
    gather_rows_in_place(data, source_rows, row_words, rows, dest_rows, tile_words);            \
  }

DEFINE_GATHER_ROWS_IN_PLACE(gather_rows_in_place_u32, unsigned int)
DEFINE_GATHER_ROWS_IN_PLACE(gather_rows_in_place_u16, unsigned short)
DEFINE_GATHER_ROWS_IN_PLACE(gather_rows_in_place_u8, unsigned char)
