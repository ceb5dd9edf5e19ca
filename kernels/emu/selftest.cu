// Kernels that check the CPU emulation itself (tests/ops/test_kernels_compile.py):
// barriers, early exits, atomics, static and dynamic shared memory. Some are
// wrong on purpose: the emulation must make them fail.

// Reverses `values` (at most blockDim.x of them) through shared memory.
extern "C" __global__ void reverse_in_shared(const int* __restrict__ input, int* __restrict__ output,
                                             int count) {
  extern __shared__ int staged[];
  const int thread = threadIdx.x;
  if (thread < count) staged[thread] = input[thread];
  __syncthreads();
  if (thread < count) output[thread] = staged[count - 1 - thread];
}

// The same without the barrier: a thread may read a slot before its owner
// writes it. Under the sequential schedule thread 0 always does.
extern "C" __global__ void reverse_in_shared_unsynchronized(const int* __restrict__ input,
                                                            int* __restrict__ output, int count) {
  extern __shared__ int staged[];
  const int thread = threadIdx.x;
  if (thread < count) staged[thread] = input[thread];
  if (thread < count) output[thread] = staged[count - 1 - thread];
}

// Threads past `count` return before the barrier; the others must not hang.
extern "C" __global__ void early_exit_before_barrier(int* __restrict__ output, int count) {
  extern __shared__ int staged[];
  const int thread = threadIdx.x;
  if (thread >= count) return;
  staged[thread] = thread + 1;
  __syncthreads();
  output[blockIdx.x * count + thread] = staged[(thread + 1) % count];
}

// Every thread of every block adds `repeats` times to one counter.
extern "C" __global__ void count_with_atomics(unsigned long long* counter, int repeats) {
  for (int repeat = 0; repeat < repeats; ++repeat) atomicAdd(counter, 1);
}

// A namespace-scope __shared__ variable, shared by the threads of a block.
__shared__ int block_sum;

extern "C" __global__ void sum_per_block(const int* __restrict__ input, int* __restrict__ sums) {
  if (threadIdx.x == 0) block_sum = 0;
  __syncthreads();
  atomicAdd(&block_sum, input[blockIdx.x * blockDim.x + threadIdx.x]);
  __syncthreads();
  if (threadIdx.x == 0) sums[blockIdx.x] = block_sum;
}

// The built-in index variables, for a 3-D grid of 3-D blocks.
extern "C" __global__ void write_indices(int* __restrict__ output) {
  const int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int threads = blockDim.x * blockDim.y * blockDim.z;
  output[block * threads + thread] = block * 1000 + thread;
}
