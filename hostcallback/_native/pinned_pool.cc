// The pinned pool (pinned_pool.h).

#include "pinned_pool.h"

#include "buffer_pool.h"

namespace hostcallback {

PinnedPool& g_pinned_pool = *new PinnedPool();

namespace {

// The driver's calls need the stream's context current on this thread; XLA's launching thread
// has it, and any other gets it pushed for the call.
class StreamContext {
 public:
  StreamContext(const cuda::Driver& driver, cuda::Stream stream) : driver_(driver) {
    cuda::Context current = nullptr;
    if (static_cast<int>(driver.ctx_get_current(&current)) == 0 && current != nullptr) return;
    cuda::Context context = nullptr;
    if (static_cast<int>(driver.stream_get_ctx(stream, &context)) == 0 && context != nullptr) {
      pushed_ = static_cast<int>(driver.ctx_push_current(context)) == 0;
    }
  }
  ~StreamContext() {
    cuda::Context popped = nullptr;
    if (pushed_) driver_.ctx_pop_current(&popped);
  }
  StreamContext(const StreamContext&) = delete;
  StreamContext& operator=(const StreamContext&) = delete;

 private:
  const cuda::Driver& driver_;
  bool pushed_ = false;
};

}  // namespace

uint8_t* PinnedPool::Get(const cuda::Driver& driver, cuda::Stream stream, size_t size,
                         size_t* capacity) {
  // Pinned memory comes in whole pages: small records share a class per page count.
  constexpr size_t kPage = 4096;
  const size_t wanted = size < BufferPool::kSizeClassesFrom ? (size + kPage - 1) / kPage * kPage
                                                            : BufferPool::ClassOf(size);
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
  const uint64_t allowance = 2 * g_max_queue_bytes.load(std::memory_order_relaxed);
  StreamContext context(driver, stream);
  if (!MakeRoom(driver, wanted, allowance)) return nullptr;
  void* data = nullptr;
  if (static_cast<int>(driver.mem_host_alloc(&data, wanted, cuda::kHostAllocPortable)) != 0 ||
      data == nullptr) {
    return nullptr;
  }
  pinned_bytes_ += wanted;
  *capacity = wanted;
  return static_cast<uint8_t*>(data);
}

bool PinnedPool::MakeRoom(const cuda::Driver& driver, uint64_t wanted, uint64_t allowance) {
  for (auto& [size, buffers] : free_) {
    while (pinned_bytes_ + wanted > allowance && !buffers.empty()) {
      driver.mem_free_host(buffers.back());
      buffers.pop_back();
      pinned_bytes_ -= size;
      free_bytes_ -= size;
    }
  }
  return pinned_bytes_ + wanted <= allowance;
}

void PinnedPool::Put(uint8_t* data, size_t capacity) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    free_[capacity].push_back(data);
    free_bytes_ += capacity;
  } catch (...) {  // no memory for the list: the buffer stays allocated, counted, unused
  }
}

void PinnedPool::NotePageableFallback() {
  std::lock_guard<std::mutex> lock(mu_);
  fallbacks_ += 1;
}

PinnedStats PinnedPool::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return {pinned_bytes_, pinned_bytes_ - free_bytes_, hits_, misses_, fallbacks_};
}

}  // namespace hostcallback
