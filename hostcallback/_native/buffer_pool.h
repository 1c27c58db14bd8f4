// Where record buffers come from and go back to: the buffer pool, the memory bound it keeps with
// the queues, and the batching of a receiver's releases.
#ifndef HOSTCALLBACK_NATIVE_BUFFER_POOL_H_
#define HOSTCALLBACK_NATIVE_BUFFER_POOL_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "record.h"

namespace hostcallback {

// ---- the memory bound (docs/reliability.md) ---------------------------------------------------

// The byte budget of each device queue (set_max_queue_bytes).
extern std::atomic<uint64_t> g_max_queue_bytes;
// The most bytes one drained batch may hold (the last drain's max_bytes, capped at the budget).
extern std::atomic<uint64_t> g_batch_bytes;
// Drained records whose arrays are still alive somewhere in Python (pool_stats()).
extern std::atomic<uint64_t> g_records_held;

// ---- the pool ---------------------------------------------------------------------------------

// What pool_stats() reports.
struct PoolStats {
  uint64_t pooled_bytes, in_use_bytes, hits, misses, records_held;
};

// Recycles record buffers. A fresh multi-megabyte allocation is a new mapping whose pages fault
// in on first touch, which costs more than the copy itself; a small one from aligned_alloc takes
// the allocator's arena lock against the receiver freeing the last batch, which costs a small
// tap half its time. Buffers of 64 KiB and up come in size classes (four per power of two, so at
// most 25 % slack), smaller ones by their exact size (a multiple of 64; free ones take at most
// an eighth of the allowance), and a buffer is kept while the pooled buffers in use and free
// together stay within one budget plus one drained batch: what the queue and a receiver's batch
// can hold at once. So a steady stream of taps always hits, and the pool adds nothing to the
// memory bound (docs/reliability.md). A buffer larger than that allowance when it is allocated
// lies outside the pool: freed when returned, and not counted against the pool's room, so one
// such record held by a consumer does not stop the pool keeping the small ones.
class BufferPool {
 public:
  static constexpr size_t kSizeClassesFrom = 64 << 10;
  static constexpr uint64_t kSmallShare = 8;     // small buffers pooled: at most cap / kSmallShare
  static constexpr size_t kPrefetchBytes = 256;  // free buffers up to this size are prefetched

  // The size class a request of `size` bytes is served from (size itself below 64 KiB).
  static size_t ClassOf(size_t size);

  // Returns null when out of memory; *capacity is what was allocated, *outside whether the
  // buffer lies outside the pool (pass it back to Put).
  uint8_t* Get(size_t size, size_t* capacity, bool* outside);

  void Put(uint8_t* data, size_t capacity, bool outside = false) noexcept;

  // Many buffers under one lock: what a receiver released while it handled a batch.
  void PutMany(std::pair<uint8_t*, size_t>* buffers, size_t count) noexcept;

  PoolStats Stats();

  uint64_t PooledBytes();

 private:
  // What the pool's buffers, in use and free, may hold together: one budget plus one batch.
  static uint64_t Allowance() noexcept;

  // Takes a buffer back into the free lists if the pool has room for it (called under mu_).
  bool KeepLocked(uint8_t* data, size_t capacity) noexcept;

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<uint8_t*>> free_;  // size class -> free buffers
  uint64_t pooled_bytes_ = 0, pooled_small_bytes_ = 0, in_use_bytes_ = 0, hits_ = 0, misses_ = 0;
  uint64_t outside_bytes_ = 0;  // in use, outside the pool
};

// Never destroyed (see the rules at the top of module.cc).
extern BufferPool& g_pool;

// ---- giving records back ----------------------------------------------------------------------

// Returns a record's buffer: to the pool at once, or, for a small record released on a thread
// that drains, with the others that thread releases (ReturnReleased).
void ReleaseRecord(const Record& record) noexcept;

// Called by a drain before it waits: what this thread released goes back to the pool, and from
// now on this thread gathers its releases.
void ReturnReleased() noexcept;

// What this thread gathered, if it drains, goes back to the pool now: before it enqueues from
// the host (so it reuses its own buffers first) and before it reports pool_stats().
void FlushOwnReleases() noexcept;

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_BUFFER_POOL_H_
