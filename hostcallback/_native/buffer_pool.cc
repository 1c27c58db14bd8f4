// Keeps the buffer pool and the memory bound, and returns a receiver's released records to the
// pool in batches. No Python.

#include "buffer_pool.h"

#include <cstdlib>

#include "pinned_pool.h"

namespace hostcallback {

std::atomic<uint64_t> g_max_queue_bytes{256ull << 20};
std::atomic<uint64_t> g_batch_bytes{0};
std::atomic<uint64_t> g_records_held{0};

size_t BufferPool::ClassOf(size_t size) {
  if (size < kSizeClassesFrom) return size;
  size_t power = kSizeClassesFrom;
  while (power * 2 <= size && power < (size_t{1} << 62)) power *= 2;
  const size_t step = power / 4;
  return (size + step - 1) / step * step;
}

uint8_t* BufferPool::Get(size_t size, size_t* capacity, bool* outside) {
  const size_t wanted = ClassOf(size);
  *capacity = wanted;
  *outside = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = free_.find(wanted);
    if (found != free_.end() && !found->second.empty()) {
      uint8_t* data = found->second.back();
      found->second.pop_back();
      // The next buffer's lines were last read by a receiver on another core: fetch them
      // now, so that the next tap does not wait for them (a read prefetch on baseline x86-64,
      // which has no write hint; it still takes most of that wait off a small tap).
      if (!found->second.empty() && wanted <= kPrefetchBytes) {
        for (size_t i = 0; i < wanted; i += 64) __builtin_prefetch(found->second.back() + i, 1);
      }
      pooled_bytes_ -= wanted;
      if (wanted < kSizeClassesFrom) pooled_small_bytes_ -= wanted;
      in_use_bytes_ += wanted;
      hits_ += 1;
      return data;
    }
    misses_ += 1;
    *outside = wanted > Allowance();
    // Counted before the allocation, undone below if it fails.
    (*outside ? outside_bytes_ : in_use_bytes_) += wanted;
  }
  auto* data = static_cast<uint8_t*>(std::aligned_alloc(kAlignment, wanted));
  if (data == nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    (*outside ? outside_bytes_ : in_use_bytes_) -= wanted;
  }
  return data;
}

void BufferPool::Put(uint8_t* data, size_t capacity, bool outside) noexcept {
  bool kept = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (outside) {
      outside_bytes_ -= capacity;
    } else {
      kept = KeepLocked(data, capacity);
    }
  }
  if (!kept) std::free(data);
}

void BufferPool::PutMany(std::pair<uint8_t*, size_t>* buffers, size_t count) noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < count; ++i) {
      if (KeepLocked(buffers[i].first, buffers[i].second)) buffers[i].first = nullptr;
    }
  }
  for (size_t i = 0; i < count; ++i) std::free(buffers[i].first);  // those not kept
}

// Copied under the lock, built into Python objects after it (module.cc): making them may run the
// garbage collector, which may free a record's arrays and so call Put on this thread.
PoolStats BufferPool::Stats() {
  PoolStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.pooled_bytes = pooled_bytes_, s.in_use_bytes = in_use_bytes_ + outside_bytes_, s.hits = hits_,
    s.misses = misses_;
  }
  s.records_held = g_records_held.load(std::memory_order_relaxed);
  return s;
}

uint64_t BufferPool::PooledBytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return pooled_bytes_;
}

uint64_t BufferPool::Allowance() noexcept {
  return g_max_queue_bytes.load(std::memory_order_relaxed) +
         g_batch_bytes.load(std::memory_order_relaxed);
}

bool BufferPool::KeepLocked(uint8_t* data, size_t capacity) noexcept {
  in_use_bytes_ -= capacity;
  const uint64_t cap = Allowance();
  const bool small = capacity < kSizeClassesFrom;
  // Small buffers keep to an eighth of the allowance: a backlog of small taps, once
  // delivered, must not leave the pool too full to keep the large buffers it exists for.
  if (in_use_bytes_ + pooled_bytes_ + capacity > cap ||
      (small && pooled_small_bytes_ + capacity > cap / kSmallShare)) {
    return false;
  }
  try {
    free_[capacity].push_back(data);
  } catch (...) {  // no memory for the bookkeeping: the buffer is freed instead
    return false;
  }
  pooled_bytes_ += capacity;
  if (small) pooled_small_bytes_ += capacity;
  return true;
}

BufferPool& g_pool = *new BufferPool();

// ---- release batching -------------------------------------------------------------------------

namespace {

// The small records a receiver thread released while it handled a batch, returned to the pool
// together: one pool lock per batch, not one per record, so the pool's lock and free lists stay
// in the device thread's cache instead of crossing between cores with every tap. They go back
// when the thread's next drain begins, when kSize are gathered, before the thread enqueues a
// record from the host, when it asks for pool_stats(), and when it exits; until then they count
// as in use. Only threads that drain gather; other threads, and large records, return them at
// once.
class ReleasedRecords {
 public:
  static constexpr size_t kSize = 64;
  ~ReleasedRecords();
  void Add(const Record& record) noexcept {
    buffers_[count_++] = {record.data, record.capacity};
    if (count_ == kSize) Flush();
  }
  void Flush() noexcept {
    if (count_ == 0) return;
    g_pool.PutMany(buffers_, count_);
    count_ = 0;
  }

 private:
  std::pair<uint8_t*, size_t> buffers_[kSize];
  size_t count_ = 0;
};

thread_local bool t_drains = false;  // this thread has called drain(): it gathers releases
thread_local ReleasedRecords t_released;

// At thread exit: what is gathered goes back, and a release after this (a record freed by a
// later thread-exit handler) goes straight to the pool instead of to a destroyed list.
ReleasedRecords::~ReleasedRecords() {
  Flush();
  t_drains = false;
}

}  // namespace

void ReleaseRecord(const Record& record) noexcept {
  if (record.pinned) {
    g_pinned_pool.Put(record.data, record.capacity);
  } else if (t_drains && !record.outside_pool && record.capacity < BufferPool::kSizeClassesFrom) {
    t_released.Add(record);
  } else {
    g_pool.Put(record.data, record.capacity, record.outside_pool);
  }
}

void ReturnReleased() noexcept {
  t_drains = true;
  t_released.Flush();
}

void FlushOwnReleases() noexcept {
  if (t_drains) t_released.Flush();
}

}  // namespace hostcallback
