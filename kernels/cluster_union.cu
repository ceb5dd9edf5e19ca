// Union of the active vocabulary sets of the clusters chosen by the hidden
// states, as a mask over the vocabulary and as the sorted list of its columns.
//
// Active sets are in CSR form: cluster c owns tokens[offsets[c]:offsets[c+1]].
//
// Three launches:
//   mark_cluster_tokens   grid-stride over chosen states, one block per state
//                         at a time, its threads stride over the cluster's
//                         tokens and store 1 into the byte mask. Concurrent
//                         stores all write the same value.
//   count_marked_tiles    one block per tile of blockDim.x * items_per_thread
//                         mask entries: the number of marked entries per tile.
//   write_marked_columns  one block per tile again: a block-wide exclusive scan
//                         of the per-thread counts, plus the tile's offset (the
//                         exclusive cumulative sum of the tile counts, computed
//                         between the launches), gives every marked entry its
//                         output position. Tiles are in vocabulary order and
//                         each thread owns consecutive entries, so the columns
//                         come out sorted.
// Both tile kernels need blockDim.x * sizeof(int) bytes of dynamic shared
// memory and a one-dimensional block. write_marked_columns never writes past
// column_count, even if the mask changed between the two launches. Cluster ids outside [0, clusters) and
// token ids outside [0, vocab_size) are skipped.

extern "C" __global__ void mark_cluster_tokens(
    const long long* __restrict__ chosen_clusters,  // (states,)
    const long long* __restrict__ offsets,          // (clusters + 1,)
    const long long* __restrict__ tokens,           // (nnz,)
    unsigned char* __restrict__ mask,               // (vocab_size,)
    int states, int clusters, int vocab_size) {
  for (int state = blockIdx.x; state < states; state += gridDim.x) {
    const long long cluster = chosen_clusters[state];
    if (cluster < 0 || cluster >= clusters) continue;
    const long long end = offsets[cluster + 1];
    for (long long entry = offsets[cluster] + threadIdx.x; entry < end; entry += blockDim.x) {
      const long long token = tokens[entry];
      if (token >= 0 && token < vocab_size) mask[token] = 1;
    }
  }
}

// Exclusive prefix sum of `value` over the threads of a one-dimensional block
// (Hillis-Steele scan in `scratch`, blockDim.x ints). Every thread must call
// it; `block_total` receives the sum over the whole block.
__device__ int block_exclusive_scan(int value, int* scratch, int* block_total) {
  const int thread = threadIdx.x;
  const int threads = blockDim.x;
  scratch[thread] = value;
  __syncthreads();
  for (int distance = 1; distance < threads; distance *= 2) {
    const int addend = thread >= distance ? scratch[thread - distance] : 0;
    __syncthreads();
    scratch[thread] += addend;
    __syncthreads();
  }
  const int inclusive = scratch[thread];
  *block_total = scratch[threads - 1];
  __syncthreads();  // scratch may be reused by the caller
  return inclusive - value;
}

// The mask entries of this thread: items_per_thread consecutive entries of
// the block's tile. Returns the first one; `count` receives how many are
// inside the vocabulary.
__device__ long long thread_entries(int vocab_size, int items_per_thread, int* count) {
  const long long first =
      (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * items_per_thread;
  const long long left = vocab_size - first;
  *count = left <= 0 ? 0 : (left < items_per_thread ? static_cast<int>(left) : items_per_thread);
  return first;
}

__device__ int count_marked(const unsigned char* mask, long long first, int count) {
  int marked = 0;
  for (int item = 0; item < count; ++item) marked += mask[first + item] != 0;
  return marked;
}

extern "C" __global__ void count_marked_tiles(
    const unsigned char* __restrict__ mask,  // (vocab_size,)
    long long* __restrict__ tile_counts,     // (tiles,)
    int vocab_size, int items_per_thread) {
  extern __shared__ int scan_scratch[];  // (blockDim.x,)
  int count;
  const long long first = thread_entries(vocab_size, items_per_thread, &count);
  int tile_total;
  block_exclusive_scan(count_marked(mask, first, count), scan_scratch, &tile_total);
  if (threadIdx.x == 0) tile_counts[blockIdx.x] = tile_total;
}

extern "C" __global__ void write_marked_columns(
    const unsigned char* __restrict__ mask,       // (vocab_size,)
    const long long* __restrict__ tile_offsets,   // (tiles,) exclusive cumsum of tile counts
    long long* __restrict__ columns,              // (column_count,)
    long long column_count, int vocab_size, int items_per_thread) {
  extern __shared__ int scan_scratch[];  // (blockDim.x,)
  int count;
  const long long first = thread_entries(vocab_size, items_per_thread, &count);
  int tile_total;
  const int rank = block_exclusive_scan(count_marked(mask, first, count), scan_scratch, &tile_total);
  long long position = tile_offsets[blockIdx.x] + rank;
  for (int item = 0; item < count; ++item) {
    if (mask[first + item] == 0) continue;
    if (position >= 0 && position < column_count) columns[position] = first + item;
    ++position;
  }
}
