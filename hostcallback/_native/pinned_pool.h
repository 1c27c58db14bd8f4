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

class PinnedPool {
 public:
  // On the launching thread of `stream` (its context current, or made current here): a buffer of
  // at least `size` bytes, *capacity what it holds. Null where the pinned memory would pass the
  // pool's allowance (twice the queue budget) or CUDA has none left: the caller then takes
  // pageable memory (counted as pageable_fallbacks), whose copy waits for the stream.
  uint8_t* Get(const cuda::Driver& driver, cuda::Stream stream, size_t size, size_t* capacity);

  // Any thread; never calls CUDA.
  void Put(uint8_t* data, size_t capacity) noexcept;

  void NotePageableFallback();

  PinnedStats Stats();

 private:
  // Frees free buffers (on the launching thread) until `wanted` more bytes fit the allowance;
  // whether they fit (called under mu_).
  bool MakeRoom(const cuda::Driver& driver, uint64_t wanted, uint64_t allowance);

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<uint8_t*>> free_;  // size class -> free buffers
  uint64_t pinned_bytes_ = 0, free_bytes_ = 0, hits_ = 0, misses_ = 0, fallbacks_ = 0;
};

// Never destroyed (see the rules at the top of module.cc).
extern PinnedPool& g_pinned_pool;

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_PINNED_POOL_H_
