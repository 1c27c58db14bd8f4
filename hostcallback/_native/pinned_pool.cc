// The pinned pool (pinned_pool.h).

#include "pinned_pool.h"

#include <unistd.h>

#include <algorithm>

#include "buffer_pool.h"

namespace hostcallback {

PinnedPool& g_pinned_pool = *new PinnedPool();

StreamContext::StreamContext(const cuda::Driver& driver, cuda::Stream stream) : driver_(driver) {
  cuda::Context current = nullptr, wanted = nullptr;
  if (static_cast<int>(driver.stream_get_ctx(stream, &wanted)) != 0) {
    driver.ctx_get_current(&context_);
    return;
  }
  context_ = wanted;
  if (wanted == nullptr) return;
  if (static_cast<int>(driver.ctx_get_current(&current)) == 0 && current == wanted) return;
  pushed_ = static_cast<int>(driver.ctx_push_current(wanted)) == 0;
}

StreamContext::~StreamContext() {
  cuda::Context popped = nullptr;
  if (pushed_) driver_.ctx_pop_current(&popped);
}

uint8_t* PinnedPool::Get(const cuda::Driver& driver, size_t size, size_t* capacity) {
  // Pinned memory comes in whole pages: small records share a class per page count.
  constexpr size_t kPage = 4096;
  const size_t wanted = size < BufferPool::kSizeClassesFrom ? (size + kPage - 1) / kPage * kPage
                                                            : BufferPool::ClassOf(size);
  std::vector<uint8_t*> surplus;  // free buffers of other sizes to give back to CUDA
  bool fits = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = free_.find(wanted);
    if (found != free_.end() && !found->second.empty()) {
      uint8_t* data = found->second.back();
      found->second.pop_back();
      free_bytes_ -= wanted;
      hits_ += 1;
      *capacity = wanted;
      return data;
    }
    misses_ += 1;
    const uint64_t allowance = Allowance();
    for (auto& [bytes, buffers] : free_) {
      while (pinned_bytes_ + wanted > allowance && !buffers.empty()) {
        surplus.push_back(buffers.back());
        buffers.pop_back();
        pinned_bytes_ -= bytes;
        free_bytes_ -= bytes;
      }
    }
    fits = pinned_bytes_ + wanted <= allowance;
    if (fits) {
      pinned_bytes_ += wanted;  // claimed now, so that no other thread overshoots the allowance
    } else {
      fallbacks_ += 1;
    }
  }
  // CUDA's calls outside the lock: pinning memory may wait for the device, whose host functions
  // give buffers back (Put) under this lock.
  ReturnToCuda(driver, surplus);
  if (!fits) return nullptr;
  void* data = nullptr;
  if (static_cast<int>(driver.mem_host_alloc(&data, wanted, cuda::kHostAllocPortable)) != 0 ||
      data == nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    pinned_bytes_ -= wanted;
    fallbacks_ += 1;
    return nullptr;
  }
  *capacity = wanted;
  return static_cast<uint8_t*>(data);
}

void PinnedPool::ReturnToCuda(const cuda::Driver& driver, const std::vector<uint8_t*>& buffers) {
  for (uint8_t* buffer : buffers) driver.mem_free_host(buffer);
}

uint64_t PinnedPool::Allowance() {
  static const uint64_t physical = [] {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page)
                                 : uint64_t{0};
  }();
  const uint64_t twice_budget = 2 * g_max_queue_bytes.load(std::memory_order_relaxed);
  return physical > 0 ? std::min(twice_budget, physical / 4) : twice_budget;
}

void PinnedPool::Put(uint8_t* data, size_t capacity) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    free_[capacity].push_back(data);
    free_bytes_ += capacity;
  } catch (...) {  // no memory for the list: the buffer stays allocated, counted, unused
  }
}

PinnedStats PinnedPool::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return {pinned_bytes_, pinned_bytes_ - free_bytes_, hits_, misses_, fallbacks_};
}

}  // namespace hostcallback
