// Page-locked host buffers for GPU tap records: the device's copies into them run asynchronously
// on its stream (a copy into pageable memory would make the launching thread wait for the
// stream). Buffers are reused by size class and never freed on the stream's host-function
// thread, which may not call CUDA.
#ifndef HOSTCALLBACK_NATIVE_PINNED_POOL_H_
#define HOSTCALLBACK_NATIVE_PINNED_POOL_H_

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda_driver.h"

namespace hostcallback {

struct PinnedStats {
  uint64_t pinned_bytes, in_use_bytes, hits, misses, pageable_fallbacks;
};

// Makes the stream's context current on this thread for the scope, where another (or none) is.
// XLA's launching thread has it current already; the pool's calls and the tap's need it.
class StreamContext {
 public:
  StreamContext(const cuda::Driver& driver, cuda::Stream stream);
  ~StreamContext();
  StreamContext(const StreamContext&) = delete;
  StreamContext& operator=(const StreamContext&) = delete;

  // The stream's context; the thread's current one where the driver cannot tell the stream's.
  cuda::Context context() const { return context_; }

 private:
  const cuda::Driver& driver_;
  cuda::Context context_ = nullptr;
  bool pushed_ = false;
};

class PinnedPool {
 public:
  // On a thread with the stream's context current (StreamContext): a buffer of at least `size`
  // bytes, *capacity what it holds. Null where the pinned memory would pass the pool's allowance
  // (twice the queue budget, at most a quarter of the machine's memory), with the free buffers
  // of other sizes given back, or CUDA has none left: the caller then takes pageable memory
  // (counted as pageable_fallbacks), whose copy waits for the stream. No CUDA call is made
  // under the pool's lock. Pinned memory lives as long as the CUDA context: the pool keeps it
  // to the end of the process, as JAX keeps its contexts.
  uint8_t* Get(const cuda::Driver& driver, size_t size, size_t* capacity);

  // Any thread; never calls CUDA.
  void Put(uint8_t* data, size_t capacity) noexcept;

  PinnedStats Stats();

 private:
  static uint64_t Allowance();
  static void ReturnToCuda(const cuda::Driver& driver, const std::vector<uint8_t*>& buffers);

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<uint8_t*>> free_;  // size class -> free buffers
  uint64_t pinned_bytes_ = 0, free_bytes_ = 0, hits_ = 0, misses_ = 0, fallbacks_ = 0;
};

// Never destroyed (see the rules at the top of module.cc).
extern PinnedPool& g_pinned_pool;

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_PINNED_POOL_H_
