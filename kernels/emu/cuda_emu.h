// CPU emulation of the CUDA execution model, for testing the kernels in
// kernels/*.cu without a GPU.
//
// The kernel sources are compiled unchanged by g++ -std=c++20: a generated
// launcher includes this header, then the .cu file, then exports every kernel
// with CUDA_EMU_EXPORT (see fairseq_fastgen/ops/_emulator.py).
//
// What is emulated, and how faithfully:
//   * Every thread of a block is a real std::thread. The threads of one block
//     run together; blocks run one after another, each on the same threads.
//   * __syncthreads() is a real barrier across the threads of the block.
//     Threads that returned from the kernel stop counting, as on the GPU.
//   * Two schedules (chosen per launch):
//       - concurrent: the OS schedules the block's threads freely, so
//         unsynchronised accesses race for real;
//       - sequential: one thread runs at a time, in ascending thread order,
//         switching only at __syncthreads() or kernel exit. Deterministic:
//         a thread reading shared data that a higher thread writes without a
//         barrier in between always sees stale (poisoned) memory.
//   * atomicAdd/atomicOr/... are real atomics (std::atomic_ref).
//   * Dynamic shared memory (`extern __shared__ T name[];`) is one buffer of
//     CUDA_EMU_SHARED_MEMORY_BYTES that every such declaration aliases, as on
//     the GPU. It is poisoned with 0xA5 bytes before every block, so reading
//     shared memory that the block did not write yields garbage.
//   * Static `__shared__` variables are supported at namespace scope only
//     (there they are shared by the threads of the running block; they are
//     not poisoned and keep their values from block to block). Declaring
//     one inside a function is rejected at compile time: with
//     -Werror=attributes the visibility attribute below turns it into an
//     error instead of silently giving every thread its own copy.
//
// This header is meant for exactly one translation unit (the launcher that
// includes the kernel source).
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <latch>
#include <memory>
#include <mutex>
#include <semaphore>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef CUDA_EMU_SHARED_MEMORY_BYTES
#define CUDA_EMU_SHARED_MEMORY_BYTES 49152
#endif

// ---------------------------------------------------------------- qualifiers
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ __attribute__((visibility("default")))

// ------------------------------------------------------------ built-in names
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
};
using uint3 = dim3;

inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = 32;

// Defined by the generated launcher; every `extern __shared__` array aliases it.
extern unsigned char cuda_emu_dynamic_shared[];

// ------------------------------------------------------------ math intrinsics
__device__ inline float __int_as_float(int bits) { return std::bit_cast<float>(bits); }
__device__ inline int __float_as_int(float value) { return std::bit_cast<int>(value); }
__device__ inline float __uint_as_float(unsigned int bits) { return std::bit_cast<float>(bits); }
__device__ inline unsigned int __float_as_uint(float value) { return std::bit_cast<unsigned int>(value); }
__device__ inline double __longlong_as_double(long long bits) { return std::bit_cast<double>(bits); }
__device__ inline long long __double_as_longlong(double value) { return std::bit_cast<long long>(value); }
using std::max;
using std::min;

// ------------------------------------------------------------------- atomics
// The value parameter is not deduced, so `atomicAdd(unsigned_ptr, 1)` works as
// with CUDA's overloads. Each returns the old value.
#define CUDA_EMU_ATOMIC(name, atomic_ref_operation)                                 \
  template <typename T>                                                            \
  __device__ inline T name(T* address, std::type_identity_t<T> value) {            \
    return std::atomic_ref<T>(*address).atomic_ref_operation(value);               \
  }
CUDA_EMU_ATOMIC(atomicAdd, fetch_add)
CUDA_EMU_ATOMIC(atomicSub, fetch_sub)
CUDA_EMU_ATOMIC(atomicExch, exchange)
CUDA_EMU_ATOMIC(atomicOr, fetch_or)
CUDA_EMU_ATOMIC(atomicAnd, fetch_and)
CUDA_EMU_ATOMIC(atomicXor, fetch_xor)
#undef CUDA_EMU_ATOMIC

template <typename T>
__device__ inline T atomicCAS(T* address, std::type_identity_t<T> compare,
                              std::type_identity_t<T> value) {
  std::atomic_ref<T>(*address).compare_exchange_strong(compare, value);
  return compare;  // holds the old value whether or not the exchange happened
}

namespace cuda_emu {
// Stores `value` unless the stored value is already at least as good; returns the old value.
template <typename T, typename Better>
inline T store_if_better(T* address, T value, Better better) {
  std::atomic_ref<T> target(*address);
  T old = target.load();
  while (better(value, old) && !target.compare_exchange_weak(old, value)) {
  }
  return old;
}
}  // namespace cuda_emu

template <typename T>
__device__ inline T atomicMax(T* address, std::type_identity_t<T> value) {
  return cuda_emu::store_if_better(address, value, std::greater<T>());
}
template <typename T>
__device__ inline T atomicMin(T* address, std::type_identity_t<T> value) {
  return cuda_emu::store_if_better(address, value, std::less<T>());
}

__device__ inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
__device__ inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// ------------------------------------------------------------ block runtime
namespace cuda_emu {

enum class Schedule : int { concurrent = 0, sequential = 1 };

// The threads of the running block, with __syncthreads() as a barrier.
class Block {
 public:
  Block(int threads, Schedule schedule)
      : threads_(threads), schedule_(schedule), state_(threads) {
    for (int t = 0; t < threads; ++t) {
      turn_.push_back(std::make_unique<std::binary_semaphore>(0));
    }
    reset();
  }

  // Before each block, while no thread is inside the kernel.
  void reset() {
    live_ = threads_;
    arrived_ = 0;
    std::fill(state_.begin(), state_.end(), State::running);
    if (schedule_ == Schedule::sequential) turn_[0]->release();
  }

  // Called by thread `rank` before it enters the kernel.
  void enter(int rank) {
    if (schedule_ == Schedule::sequential) turn_[rank]->acquire();
  }

  // __syncthreads() of thread `rank`.
  void sync(int rank) {
    std::unique_lock<std::mutex> lock(mutex_);
    const unsigned long long phase = phase_;
    state_[rank] = State::at_barrier;
    ++arrived_;
    const bool last = arrived_ == live_;
    if (last) release_barrier();
    if (schedule_ == Schedule::sequential) {
      const int next = last ? next_running(-1) : next_running(rank);
      lock.unlock();
      turn_[next]->release();
      turn_[rank]->acquire();
    } else {
      changed_.wait(lock, [&] { return phase_ != phase; });
    }
  }

  // Thread `rank` returned from the kernel: it no longer takes part in barriers.
  void leave(int rank) {
    std::unique_lock<std::mutex> lock(mutex_);
    state_[rank] = State::exited;
    --live_;
    const bool completes_barrier = arrived_ > 0 && arrived_ == live_;
    if (completes_barrier) release_barrier();
    if (schedule_ == Schedule::sequential && live_ > 0) {
      const int next = completes_barrier ? next_running(-1) : next_running(rank);
      lock.unlock();
      turn_[next]->release();
    }
  }

 private:
  enum class State : unsigned char { running, at_barrier, exited };

  void release_barrier() {
    arrived_ = 0;
    ++phase_;
    for (State& state : state_) {
      if (state == State::at_barrier) state = State::running;
    }
    changed_.notify_all();
  }

  // The first running thread after `rank`, wrapping around.
  int next_running(int rank) const {
    for (int step = 1; step <= threads_; ++step) {
      const int candidate = (rank + step + threads_) % threads_;
      if (state_[candidate] == State::running) return candidate;
    }
    return rank;  // unreachable while some thread still runs
  }

  const int threads_;
  const Schedule schedule_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<State> state_;
  std::vector<std::unique_ptr<std::binary_semaphore>> turn_;
  int live_ = 0;
  int arrived_ = 0;
  unsigned long long phase_ = 0;
};

inline thread_local Block* current_block = nullptr;
inline thread_local int current_rank = 0;

inline void poison_shared_memory() {
  std::memset(cuda_emu_dynamic_shared, 0xA5, CUDA_EMU_SHARED_MEMORY_BYTES);
}

inline dim3 unflatten(unsigned long long index, dim3 extent) {
  return dim3(static_cast<unsigned int>(index % extent.x),
              static_cast<unsigned int>(index / extent.x % extent.y),
              static_cast<unsigned int>(index / extent.x / extent.y));
}

template <typename... Params, std::size_t... I>
void invoke(void (*kernel)(Params...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<Params*>(args[I])...);
}

// Checks the launch configuration against the limits of current GPUs;
// returns an error message, or nullptr when the launch is valid.
inline const char* invalid_configuration(dim3 grid, dim3 block, std::size_t shared_bytes) {
  const unsigned long long threads =
      static_cast<unsigned long long>(block.x) * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return "grid has a zero dimension";
  if (grid.x > 2147483647u || grid.y > 65535u || grid.z > 65535u) return "grid too large";
  if (threads == 0 || threads > 1024 || block.z > 64) return "invalid block dimensions";
  if (shared_bytes > CUDA_EMU_SHARED_MEMORY_BYTES) return "too much dynamic shared memory";
  return nullptr;
}

// One process-wide launch at a time: shared memory is a single buffer.
inline std::mutex& launch_mutex() {
  static std::mutex mutex;
  return mutex;
}

// Runs kernel<<<grid, block, shared_bytes>>>(args...) and waits for it.
// `args` points at the argument values, as with cudaLaunchKernel.
// Returns 0, or 1 with a message in `error`.
template <typename... Params>
int launch(void (*kernel)(Params...), const unsigned int* grid3, const unsigned int* block3,
           std::size_t shared_bytes, int schedule, void** args, char* error,
           std::size_t error_size) {
  const dim3 grid(grid3[0], grid3[1], grid3[2]);
  const dim3 block(block3[0], block3[1], block3[2]);
  if (const char* problem = invalid_configuration(grid, block, shared_bytes)) {
    std::snprintf(error, error_size, "invalid launch configuration: %s", problem);
    return 1;
  }
  std::lock_guard<std::mutex> serialized(launch_mutex());
  const int threads = static_cast<int>(block.x * block.y * block.z);
  const unsigned long long blocks = static_cast<unsigned long long>(grid.x) * grid.y * grid.z;
  Block running(threads, static_cast<Schedule>(schedule));
  poison_shared_memory();
  auto next_block = [&running]() noexcept {
    running.reset();
    poison_shared_memory();
  };
  std::barrier block_done(threads, next_block);

  // Threads wait at the gate until all of them exist; if one cannot be
  // started, the others are told to leave without running the kernel.
  std::latch all_started(1);
  bool start_failed = false;
  auto run_thread = [&](int rank) {
    all_started.wait();
    if (start_failed) return;
    current_block = &running;
    current_rank = rank;
    threadIdx = unflatten(static_cast<unsigned long long>(rank), block);
    blockDim = block;
    gridDim = grid;
    for (unsigned long long b = 0; b < blocks; ++b) {
      blockIdx = unflatten(b, grid);
      running.enter(rank);
      invoke(kernel, args, std::index_sequence_for<Params...>{});
      running.leave(rank);
      block_done.arrive_and_wait();
    }
  };
  std::vector<std::jthread> workers;  // joined when the function returns
  workers.reserve(threads);
  try {
    for (int rank = 0; rank < threads; ++rank) workers.emplace_back(run_thread, rank);
  } catch (const std::system_error& failure) {
    start_failed = true;
    all_started.count_down();
    std::snprintf(error, error_size, "could not start %d threads: %s", threads, failure.what());
    return 1;
  }
  all_started.count_down();
  return 0;
}

// numpy dtype name of a kernel parameter type ("pointer<itemsize>" for
// pointers), so that the Python side can check and pack the arguments.
template <typename T>
constexpr const char* parameter_code() {
  if constexpr (std::is_pointer_v<T>) {
    using Pointee = std::remove_cv_t<std::remove_pointer_t<T>>;
    if constexpr (std::is_void_v<Pointee>) return "pointer0";
    else if constexpr (sizeof(Pointee) == 1) return "pointer1";
    else if constexpr (sizeof(Pointee) == 2) return "pointer2";
    else if constexpr (sizeof(Pointee) == 4) return "pointer4";
    else if constexpr (sizeof(Pointee) == 8) return "pointer8";
    else return "pointer0";
  } else if constexpr (std::is_same_v<T, bool>) {
    return "bool";
  } else if constexpr (std::is_floating_point_v<T>) {
    return sizeof(T) == 4 ? "float32" : "float64";
  } else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    return sizeof(T) == 1 ? "int8" : sizeof(T) == 2 ? "int16" : sizeof(T) == 4 ? "int32" : "int64";
  } else if constexpr (std::is_integral_v<T>) {
    return sizeof(T) == 1 ? "uint8" : sizeof(T) == 2 ? "uint16" : sizeof(T) == 4 ? "uint32" : "uint64";
  } else {
    return "unsupported";
  }
}

// Comma-separated parameter codes of a kernel.
template <typename... Params>
const char* signature(void (*)(Params...)) {
  static const std::string joined = [] {
    std::string text;
    ((text += parameter_code<Params>(), text += ","), ...);
    if (!text.empty()) text.pop_back();
    return text;
  }();
  return joined.c_str();
}

}  // namespace cuda_emu

__device__ inline void __syncthreads() {
  cuda_emu::current_block->sync(cuda_emu::current_rank);
}

// Exports `kernel` to the Python emulator (fairseq_fastgen/ops/_emulator.py):
//   const char* cuda_emu_signature__<kernel>()   parameter codes
//   int cuda_emu_launch__<kernel>(grid[3], block[3], shared_bytes, schedule,
//                                 args, error, error_size)
#define CUDA_EMU_EXPORT(kernel)                                                              \
  extern "C" const char* cuda_emu_signature__##kernel() {                                    \
    return cuda_emu::signature(kernel);                                                       \
  }                                                                                           \
  extern "C" int cuda_emu_launch__##kernel(const unsigned int* grid, const unsigned int* block, \
                                           std::size_t shared_bytes, int schedule,            \
                                           void** args, char* error, std::size_t error_size) { \
    return cuda_emu::launch(kernel, grid, block, shared_bytes, schedule, args, error,         \
                            error_size);                                                      \
  }
