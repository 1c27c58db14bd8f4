// The device side of hostcallback: per-device outfeed queues and the XLA FFI tap handler.
//
// The handler runs on XLA's device thread. It copies the tapped buffers into one record
// (header + payload, layout in docs/wire-format.md and hostcallback/wire.py) and appends it
// to that device's queue. It never runs Python and never takes the GIL. The receiver threads
// in Python call drain(), which waits here with the GIL released, gathers a batch, and decodes
// it here: each record comes out as (consumer id, device, sequence, flags, arrays), the arrays
// read-only numpy views of the record's memory (no copy), barrier markers apart. Deciding what
// to do with a record (which consumer, pytrees, errors, barriers) lives in Python.
//
// Rules this file keeps (docs/reliability.md):
// - No C++ exception crosses the FFI boundary or the nanobind boundary unhandled; a record is
//   never lost or leaked on the way out of drain().
// - Global state is allocated once and never destroyed: XLA's device threads may still run
//   while the interpreter exits, after static destructors would have run.
// - Queues are keyed by (platform, device id): ids repeat across platforms.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <map>
#include <set>
#include <stdexcept>
#include <unordered_map>
#include <utility>
#include <vector>

#define PY_ARRAY_UNIQUE_SYMBOL hostcallback_ARRAY_API  // frames.cc uses the same table
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <Python.h>
#include <numpy/arrayobject.h>

#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/tuple.h"
#include "nanobind/stl/vector.h"
#include "xla/ffi/api/ffi.h"
#include "gil.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace {

// ---- wire format (mirrors hostcallback/wire.py) ------------------------------------------

constexpr uint32_t kMagic = 0x31424348;  // the bytes "HCB1"
constexpr uint16_t kVersion = 1;
constexpr size_t kFixedHeaderBytes = 48;
constexpr size_t kDescriptorBytes = 16;  // plus 8 bytes per dimension
constexpr size_t kAlignment = 64;        // every payload starts 64-byte aligned
constexpr size_t kSequenceOffset = 24;
constexpr size_t kRecordSizeOffset = 40;

size_t AlignUp(size_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

// One array to copy into a record. dims points at the caller's dimensions (the FFI buffer's or
// the host leaf's), valid for the duration of the enqueue: no allocation per array.
struct ArrayView {
  uint8_t dtype;
  const int64_t* dims;
  size_t ndim;
  const void* data;
  uint64_t byte_size;
};

// The arrays of one record: a tap handler's on its stack, the host's in a vector.
struct ArrayViews {
  ArrayViews(const ArrayView* views, size_t n) : first(views), count(n) {}
  ArrayViews(const std::vector<ArrayView>& views) : first(views.data()), count(views.size()) {}
  ArrayViews(std::vector<ArrayView>&&) = delete;  // a view of a temporary would dangle
  const ArrayView* begin() const { return first; }
  const ArrayView* end() const { return first + count; }
  size_t size() const { return count; }

  const ArrayView* first;
  size_t count;
};

template <typename T>
void Put(uint8_t* at, T value) {
  std::memcpy(at, &value, sizeof(T));
}

// A record's bytes, 64-byte aligned. Its size lives here, outside the bytes, so that nothing
// written into a record can change how much memory is returned (or reused) for it. capacity is
// what was allocated (a pool size class), size what the record uses and the budget counts.
struct Record {
  uint8_t* data = nullptr;
  size_t size = 0;
  size_t capacity = 0;
  bool outside_pool = false;  // larger than the pool could keep: freed, never pooled
  bool urgent = false;  // a call or a barrier marker: its queue wakes the receiver at once
};

std::atomic<uint64_t> g_max_queue_bytes{256ull << 20};
// The most bytes one drained batch may hold (the last drain's max_bytes, capped at the budget).
std::atomic<uint64_t> g_batch_bytes{0};
// Drained records whose arrays are still alive somewhere in Python (pool_stats()).
std::atomic<uint64_t> g_records_held{0};

// Recycles record buffers. A fresh multi-megabyte allocation is a new mapping whose pages fault
// in on first touch, which costs more than the copy itself; a small one from aligned_alloc takes
// the allocator's arena lock against the receiver freeing the last batch, which cost a small tap
// half its time. Buffers of 64 KiB and up come in size classes (four per power of two, so at
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
  static constexpr uint64_t kSmallShare = 8;  // small buffers pooled: at most cap / kSmallShare
  static constexpr size_t kPrefetchBytes = 256;  // free buffers up to this size are prefetched

  // The size class a request of `size` bytes is served from (size itself below 64 KiB).
  static size_t ClassOf(size_t size) {
    if (size < kSizeClassesFrom) return size;
    size_t power = kSizeClassesFrom;
    while (power * 2 <= size && power < (size_t{1} << 62)) power *= 2;
    const size_t step = power / 4;
    return (size + step - 1) / step * step;
  }

  // Returns null when out of memory; *capacity is what was allocated, *outside whether the
  // buffer lies outside the pool (pass it back to Put).
  uint8_t* Get(size_t size, size_t* capacity, bool* outside) {
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
        // which has no write hint; it still took most of that wait off a small tap).
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

  void Put(uint8_t* data, size_t capacity, bool outside = false) noexcept {
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

  // Many buffers under one lock: what a receiver released while it handled a batch.
  void PutMany(std::pair<uint8_t*, size_t>* buffers, size_t count) noexcept {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < count; ++i) {
        if (KeepLocked(buffers[i].first, buffers[i].second)) buffers[i].first = nullptr;
      }
    }
    for (size_t i = 0; i < count; ++i) std::free(buffers[i].first);  // those not kept
  }

  // Copied under the lock, built into Python objects after it: making them may run the garbage
  // collector, which may free a record's arrays and so call Put on this thread.
  nb::dict Stats() {
    uint64_t pooled, in_use, hits, misses;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pooled = pooled_bytes_, in_use = in_use_bytes_ + outside_bytes_, hits = hits_,
      misses = misses_;
    }
    nb::dict d;
    d["pooled_bytes"] = pooled;
    d["in_use_bytes"] = in_use;
    d["hits"] = hits;
    d["misses"] = misses;
    d["records_held"] = g_records_held.load(std::memory_order_relaxed);
    return d;
  }

  uint64_t PooledBytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return pooled_bytes_;
  }

 private:
  // What the pool's buffers, in use and free, may hold together: one budget plus one batch.
  static uint64_t Allowance() noexcept {
    return g_max_queue_bytes.load(std::memory_order_relaxed) +
           g_batch_bytes.load(std::memory_order_relaxed);
  }

  // Takes a buffer back into the free lists if the pool has room for it (called under mu_).
  bool KeepLocked(uint8_t* data, size_t capacity) noexcept {
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

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<uint8_t*>> free_;  // size class -> free buffers
  uint64_t pooled_bytes_ = 0, pooled_small_bytes_ = 0, in_use_bytes_ = 0, hits_ = 0, misses_ = 0;
  uint64_t outside_bytes_ = 0;  // in use, outside the pool
};

// Never destroyed (see the rules at the top).
BufferPool& g_pool = *new BufferPool();

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

void ReleaseRecord(const Record& record) noexcept {
  if (t_drains && !record.outside_pool && record.capacity < BufferPool::kSizeClassesFrom) {
    t_released.Add(record);
  } else {
    g_pool.Put(record.data, record.capacity, record.outside_pool);
  }
}

// Called by a drain before it waits: what this thread released goes back to the pool.
void ReturnReleased() noexcept {
  t_drains = true;
  t_released.Flush();
}

// ---- copying large arrays ---------------------------------------------------------------------

// Arrays of at least this many bytes are copied by several of XLA's intra-op threads at once,
// as XLA's own fusions run, in chunks of kCopyChunkBytes.
constexpr size_t kParallelCopyBytes = size_t{1} << 20;
constexpr size_t kCopyChunkBytes = size_t{256} << 10;

// The chunks of one copy. The calling thread copies chunks too and waits only for chunks that
// another thread has begun, never for a helper that has not started: so the copy finishes even
// when every pool thread is busy, and a helper that starts late finds nothing left and touches
// neither buffer. Shared, not on the stack, because such a helper may run after the handler
// returned.
struct ChunkedCopy {
  ChunkedCopy(uint8_t* to, const uint8_t* from, size_t n)
      : dst(to), src(from), bytes(n), chunks((n + kCopyChunkBytes - 1) / kCopyChunkBytes) {}

  void CopyChunks() noexcept {
    for (size_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      const size_t begin = c * kCopyChunkBytes;
      std::memcpy(dst + begin, src + begin, std::min(kCopyChunkBytes, bytes - begin));
      done.fetch_add(1, std::memory_order_release);
    }
  }

  uint8_t* const dst;
  const uint8_t* const src;
  const size_t bytes, chunks;
  std::atomic<size_t> next{0}, done{0};
};

// memcpy, on several threads of `pool` for a large array (pool may be null: one thread).
void CopyArray(uint8_t* dst, const uint8_t* src, size_t bytes, ffi::ThreadPool* pool) {
  const int64_t threads = pool != nullptr && bytes >= kParallelCopyBytes ? pool->num_threads() : 0;
  if (threads < 2) {
    std::memcpy(dst, src, bytes);
    return;
  }
  auto copy = std::make_shared<ChunkedCopy>(dst, src, bytes);
  // More threads than cores only take turns (forced CPU devices share one pool of 4 on 2 cores).
  static const size_t cores = std::max(1u, std::thread::hardware_concurrency());
  const size_t helpers =
      std::min({static_cast<size_t>(threads), cores, copy->chunks}) - 1;
  for (size_t i = 0; i < helpers; ++i) {
    try {
      pool->Schedule([copy]() noexcept { copy->CopyChunks(); });
    } catch (...) {  // no memory for the task: this thread copies what is left
      break;
    }
  }
  copy->CopyChunks();
  while (copy->done.load(std::memory_order_acquire) < copy->chunks) std::this_thread::yield();
}

constexpr uint16_t kFlagExpectsResponse = 1;  // a `call`: the device waits for the host's answer
constexpr uint64_t kBarrierMarkerId = 0;       // registry.BARRIER_MARKER_ID

// Zeroes n bytes (a multiple of kAlignment) a line at a time: at -O3 a fixed-size memset
// compiles to a few vector stores, where a variable one (or any, at -Os: see CMakeLists.txt) is
// a `rep stos` whose start-up cost a small tap a quarter of its enqueue.
void ZeroLines(uint8_t* at, size_t n) {
  for (size_t i = 0; i < n; i += kAlignment) std::memset(at + i, 0, kAlignment);
}

// Builds the record; every byte that is not a field or an array element is zero (padding
// included), so a recycled buffer never carries an earlier record's bytes. Throws bad_alloc.
// A pool (XLA's intra-op threads) copies large arrays on several threads.
Record EncodeRecord(uint64_t consumer_id, uint32_t device, ArrayViews arrays, uint16_t flags = 0,
                    ffi::ThreadPool* pool = nullptr) {
  size_t header = kFixedHeaderBytes;
  for (const ArrayView& a : arrays) header += kDescriptorBytes + 8 * a.ndim;
  header = AlignUp(header);
  size_t size = header;
  for (const ArrayView& a : arrays) size = AlignUp(size) + a.byte_size;
  size = AlignUp(std::max<size_t>(size, kAlignment));

  Record r;
  r.data = g_pool.Get(size, &r.capacity, &r.outside_pool);
  if (r.data == nullptr) throw std::bad_alloc();
  r.size = size;
  ZeroLines(r.data, header);
  Put<uint32_t>(r.data + 0, kMagic);
  Put<uint16_t>(r.data + 4, kVersion);
  Put<uint16_t>(r.data + 6, flags);
  Put<uint64_t>(r.data + 8, consumer_id);
  Put<uint32_t>(r.data + 16, device);
  Put<uint32_t>(r.data + 20, static_cast<uint32_t>(arrays.size()));
  Put<uint64_t>(r.data + kSequenceOffset, 0);  // set when the record joins its queue
  Put<uint32_t>(r.data + 32, static_cast<uint32_t>(header));
  Put<uint32_t>(r.data + 36, 0);  // reserved
  Put<uint64_t>(r.data + kRecordSizeOffset, size);
  uint8_t* at = r.data + kFixedHeaderBytes;
  size_t offset = header;
  for (const ArrayView& a : arrays) {
    Put<uint8_t>(at + 0, a.dtype);
    Put<uint16_t>(at + 2, static_cast<uint16_t>(a.ndim));
    Put<uint64_t>(at + 8, a.byte_size);
    for (size_t i = 0; i < a.ndim; ++i) Put<int64_t>(at + 16 + 8 * i, a.dims[i]);
    at += kDescriptorBytes + 8 * a.ndim;
    offset = AlignUp(offset);
    if (a.byte_size > 0) {
      // The padding after an array lies in its last line: zeroed first, then copied over.
      ZeroLines(r.data + AlignUp(offset + a.byte_size) - kAlignment, kAlignment);
      CopyArray(r.data + offset, static_cast<const uint8_t*>(a.data), a.byte_size, pool);
    }
    offset += a.byte_size;
  }
  // size is AlignUp(offset) (the same sum as above): the last array's line ends the record.
  return r;
}

// ---- timeouts ---------------------------------------------------------------------------------

// Waits longer than this (about 31 years) mean "forever": a std::chrono duration of a huge or
// infinite double overflows and would end the wait at once.
constexpr double kForeverSeconds = 1e9;

// timeout_s <= 0 (no timeout given), infinity and anything above kForeverSeconds wait forever.
bool WaitsForever(double timeout_s) { return timeout_s <= 0 || timeout_s >= kForeverSeconds; }

// Why a timeout from Python is refused, or the empty string.
std::string CheckTimeout(double timeout_s) {
  if (std::isnan(timeout_s)) return "timeout must be a number of seconds, not NaN";
  if (timeout_s < 0) return "timeout must not be negative (0 or infinity: wait forever)";
  return "";
}

constexpr char kTimeoutPrefix[] =
    "hostcallback: the host did not answer this call within its timeout of ";

std::string TimeoutMessage(double timeout_s) {
  char seconds[32];
  std::snprintf(seconds, sizeof(seconds), "%g", timeout_s);
  return std::string(kTimeoutPrefix) +
         seconds + " s. If the call function runs JAX work while a computation over several "
         "devices waits for it, XLA's CPU client may never run that work (it holds at most 32 "
         "computations in flight per device, JAX's own callbacks hang there too): call "
         "jax.block_until_ready on each step's result, or run that work outside the function";
}

// ---- the queues ---------------------------------------------------------------------------

struct QueueStats {
  uint64_t records_enqueued = 0, bytes_enqueued = 0;  // taps and calls; barrier markers apart
  uint64_t records_delivered = 0, bytes_delivered = 0;
  uint64_t markers_enqueued = 0, markers_delivered = 0;
  uint64_t bytes_queued = 0, peak_bytes_queued = 0;
  uint64_t waits = 0, wait_ns = 0;
  uint64_t producers_waiting = 0;
  uint64_t batches = 0;  // non-empty drains: records_delivered / batches is the mean batch
  uint64_t receiver_wakeups = 0;  // times a producer woke the receiver (a syscall on its thread)
};

// Whether a record is a barrier marker (consumer id kBarrierMarkerId, at byte 8 of its header).
bool IsBarrierMarker(const Record& record) {
  uint64_t consumer_id;
  std::memcpy(&consumer_id, record.data + 8, sizeof(consumer_id));
  return consumer_id == kBarrierMarkerId;
}

class DeviceQueue;

// Where the receiver leaves the host's answer to a `call` record, keyed by (queue, sequence),
// and where the device thread that sent the record waits for it. An entry exists exactly while
// its call waits: it is made before the record can be drained and erased when the wait ends,
// however it ends, so answers that come too late are dropped and the table returns to empty.
struct Response {
  std::string error;  // empty: success
  std::vector<std::vector<uint8_t>> results;
};

class Responses {
 public:
  using Key = std::pair<const DeviceQueue*, uint64_t>;

  // Called under the queue's lock, before the call record is visible to any receiver.
  void Expect(Key key) {
    std::lock_guard<std::mutex> lock(mu_);
    table_[key];
  }

  // The call record never joined its queue after all: forget its entry.
  void Forget(Key key) noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    table_.erase(key);
  }

  // Stores the answer if its call still waits; drops it otherwise (timed out, stopped).
  void Set(Key key, Response response) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto found = table_.find(key);
      if (found == table_.end() || found->second.answered) return;
      found->second.answered = true;
      found->second.response = std::move(response);
    }
    cv_.notify_all();
  }

  // Why no answer came (stopped, timed out), or the empty string with *out set.
  // timeout_s is what is left of the call's timeout, the whole of which the message names.
  std::string Wait(Key key, double timeout_s, Response* out, double call_timeout_s) {
    std::unique_lock<std::mutex> lock(mu_);
    auto entry = table_.find(key);  // map iterators stay valid while others come and go
    if (entry == table_.end()) return kStoppedMessage;
    auto answered = [&] {
      return closed_ || entry->second.answered || failed_.count(key.first) > 0;
    };
    if (WaitsForever(timeout_s)) {
      cv_.wait(lock, answered);
    } else {
      cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), answered);
    }
    const bool got = entry->second.answered;
    if (got) *out = std::move(entry->second.response);
    table_.erase(entry);
    if (got) return "";
    if (auto failed = failed_.find(key.first); failed != failed_.end()) return failed->second;
    if (closed_) return kStoppedMessage;
    return TimeoutMessage(call_timeout_s);
  }

  // (calls waiting for an answer, answers not yet taken by their call) for one queue.
  std::pair<uint64_t, uint64_t> Counts(const DeviceQueue* queue) {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t waiting = 0, unclaimed = 0;
    for (const auto& [key, entry] : table_) {
      if (key.first != queue) continue;
      (entry.answered ? unclaimed : waiting) += 1;
    }
    return {waiting, unclaimed};
  }

  void SetClosed(bool closed) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = closed;
    }
    cv_.notify_all();
  }

  // Every waiting and future call on this queue fails with the reason (its receiver died).
  void Fail(const DeviceQueue* queue, const std::string& reason) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      failed_[queue] = reason;
    }
    cv_.notify_all();
  }

  static constexpr char kStoppedMessage[] =
      "hostcallback: the outfeed receiver was stopped (stop_outfeed_receiver()); "
      "taps cannot be delivered in this process any more";

 private:
  struct Entry {
    bool answered = false;
    Response response;
  };
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Key, Entry> table_;
  std::map<const DeviceQueue*, std::string> failed_;
  bool closed_ = false;
};

Responses& g_responses = *new Responses();

// The records of one queue, oldest first, in a circular buffer that grows by doubling: a
// stream of taps allocates nothing per record (a std::deque took a block from malloc every 16
// records, which the receiver's thread then freed). Once empty, a ring that a backlog grew
// past kKeptSlots gives all its memory back (TakeSpare).
class RecordRing {
 public:
  static constexpr size_t kKeptSlots = size_t{1} << 16;  // 2 MiB

  bool empty() const { return count_ == 0; }
  size_t size() const { return count_; }
  const Record& front() const { return slots_[head_]; }

  // Throws bad_alloc with the ring unchanged.
  void push_back(const Record& record) {
    if (count_ == slots_.size()) Grow();
    slots_[(head_ + count_) & (slots_.size() - 1)] = record;
    count_ += 1;
  }

  void pop_front() {
    head_ = (head_ + 1) & (slots_.size() - 1);
    count_ -= 1;
  }

  // All the memory of an empty ring grown past kKeptSlots (none otherwise), for the caller to
  // free outside its lock.
  std::vector<Record> TakeSpare() {
    std::vector<Record> spare;
    if (count_ == 0 && slots_.size() > kKeptSlots) {
      spare.swap(slots_);
      head_ = 0;
    }
    return spare;
  }

 private:
  void Grow() {
    std::vector<Record> bigger(std::max<size_t>(64, slots_.size() * 2));
    for (size_t i = 0; i < count_; ++i) bigger[i] = slots_[(head_ + i) & (slots_.size() - 1)];
    slots_.swap(bigger);
    head_ = 0;
  }

  std::vector<Record> slots_;  // empty, or a power of two of them
  size_t head_ = 0, count_ = 0;
};

// One device's outfeed: a FIFO of records under a byte budget. Producers (device threads)
// wait while the budget is spent and are admitted in arrival order, so a record larger than
// the whole budget, which waits for an empty queue and then goes in alone, is not overtaken by
// steady small traffic. Nothing is ever refused for its size or dropped.
class DeviceQueue {
 public:
  static constexpr int64_t kClosed = -1, kTimedOut = -2;

  explicit DeviceQueue(int device_id) : device(device_id) {}

  const int device;  // the id it is keyed by (with its platform)

  // Returns the record's sequence number, kClosed when the queue was closed (receiver stopped)
  // or kTimedOut when there was no room within timeout_s (a `call`'s timeout; taps wait
  // forever). A `call` record registers for its answer before any receiver can see it.
  // `urgent` (a call or a barrier marker) wakes a coalescing receiver at once. On kClosed,
  // kTimedOut or an exception the record stays the caller's.
  int64_t Push(Record record, bool expects_response, bool urgent, double timeout_s = 0) {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t ticket = next_ticket_++;
    auto admitted = [&] { return closed_ || (ticket <= admitted_ && Fits(record.size)); };
    if (!admitted()) {
      auto start = std::chrono::steady_clock::now();
      stats_.producers_waiting += 1;
      // A receiver that is gathering a batch must not keep a full queue waiting.
      if (receivers_waiting_ > 0) not_empty_.notify_all();
      bool in = true;
      if (WaitsForever(timeout_s)) {
        not_full_.wait(lock, admitted);
      } else {
        in = not_full_.wait_for(lock, std::chrono::duration<double>(timeout_s), admitted);
      }
      stats_.producers_waiting -= 1;
      stats_.waits += 1;
      stats_.wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now() - start)
                            .count();
      if (!in) {
        GiveUp(ticket);
        lock.unlock();
        not_full_.notify_all();  // those behind this ticket may go in now
        return kTimedOut;
      }
    }
    if (closed_) return kClosed;
    const uint64_t sequence = next_sequence_;
    try {
      if (expects_response) g_responses.Expect({this, sequence});
      Put<uint64_t>(record.data + kSequenceOffset, sequence);
      record.urgent = urgent;
      records_.push_back(record);
    } catch (...) {  // out of memory: nothing joined, and the line behind this ticket moves on
      if (expects_response) g_responses.Forget({this, sequence});
      GiveUp(ticket);
      lock.unlock();
      not_full_.notify_all();
      throw;
    }
    next_sequence_ += 1;
    Admit(ticket);
    (IsBarrierMarker(record) ? stats_.markers_enqueued : stats_.records_enqueued) += 1;
    stats_.bytes_enqueued += record.size;
    stats_.bytes_queued += record.size;
    stats_.peak_bytes_queued = std::max(stats_.peak_bytes_queued, stats_.bytes_queued);
    if (urgent) urgent_queued_ += 1;
    // Wake the receiver only when it sleeps and, while it gathers a batch, only when the batch
    // is ready: under load a receiver wakes once per batch, not once per record.
    const bool wake = receivers_waiting_ > coalescing_ || (receivers_waiting_ > 0 && BatchReady());
    const bool others_wait = stats_.producers_waiting > 0;
    if (wake) stats_.receiver_wakeups += 1;
    lock.unlock();
    if (wake) not_empty_.notify_all();  // one receiver per queue: all is one
    if (others_wait) not_full_.notify_all();  // the next in line may fit now
    return static_cast<int64_t>(sequence);
  }

  // Waits up to timeout_s for a record, then takes records up to the given limits (at least
  // one when any is queued). With coalesce_s > 0 it then waits up to that long for a fuller
  // batch, unless a call or barrier marker is queued, a producer waits for room or the batch is
  // full already: a lone record is late by at most coalesce_s. Such a wait is made only while
  // it pays: after one that gathered nothing, later Pops skip it (a record of a slow stream
  // would pay a second wake-up for it) until one finds more than one record queued, as in a
  // burst or under load. With linger_s > 0, while records come less than linger_s apart (the
  // last Pop found some, or had them within linger_s), a Pop first waits up to linger_s the same
  // way, asking no producer to wake it: such a stream (one tap a short training step) costs the
  // receiver one wake-up per linger_s and its producers none, and a record in it is late by at
  // most linger_s. A slower stream is not lingered for, which would only add a wake-up, so the
  // first record after a quiet spell wakes the receiver at once. A closed queue still hands out
  // what it holds. Never loses a record: the output is reserved before any leaves the queue.
  //
  // Why wait at all: on the host a record costs mostly the receiver's wake-up, not its Python (a
  // thread that sleeps and wakes costs about 40 us of CPU on a small VM, delivering a record
  // about 1 us), and on a 2-core machine that CPU is taken from the computation. The receiver
  // passes coalesce_s = 200 us and linger_s = 1 ms (receiver.py: _COALESCE_SECONDS,
  // _LINGER_SECONDS). A gathering receiver is woken only for a ready batch (Enqueue), and
  // queue_stats() counts the producers' wake-up calls as receiver_wakeups. The coalescing wait is
  // what gathers a burst of taps that follows a quiet spell. Measurements:
  // docs/performance-log.md (2026-11-24).
  std::vector<Record> Pop(size_t max_records, size_t max_bytes, double timeout_s,
                          double coalesce_s = 0, double linger_s = 0) {
    std::vector<Record> out;
    std::unique_lock<std::mutex> lock(mu_);
    batch_records_ = std::max<size_t>(max_records, 1);
    batch_bytes_ = std::max<size_t>(max_bytes, 1);
    bool soon = true;  // records were there, or came within linger_s
    if (records_.empty() && !closed_) {
      auto ready = [&] { return closed_ || !records_.empty(); };
      auto after = [](auto start, double seconds) {
        return start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                           std::chrono::duration<double>(seconds));
      };
      receivers_waiting_ += 1;
      const auto start = std::chrono::steady_clock::now();
      if (linger_s > 0 && streaming_) {
        GatherFor(lock, WaitsForever(timeout_s) ? linger_s : std::min(linger_s, timeout_s));
        soon = ready();
      }
      if (!ready()) {
        if (WaitsForever(timeout_s)) {
          not_empty_.wait(lock, ready);
        } else {
          not_empty_.wait_until(lock, after(start, timeout_s), ready);
        }
        soon = soon && std::chrono::steady_clock::now() < after(start, linger_s);
        // (A batch ready at once, as a lone call or barrier marker is, opens no window and
        // so says nothing of whether one pays.)
        if (coalesce_s > 0 && !records_.empty() && coalescing_pays_ && !BatchReady()) {
          const size_t found = records_.size();
          GatherFor(lock, coalesce_s);
          coalescing_pays_ = records_.size() > found;
        }
      }
      receivers_waiting_ -= 1;
    }
    if (records_.size() > 1) coalescing_pays_ = true;  // a burst, or load: a window gathers
    out.reserve(std::min(max_records, records_.size()));
    size_t bytes = 0;
    size_t markers = 0;
    while (!records_.empty() && out.size() < max_records && (out.empty() || bytes < max_bytes)) {
      out.push_back(records_.front());
      bytes += records_.front().size;
      if (records_.front().urgent) {
        urgent_queued_ -= 1;
        markers += IsBarrierMarker(records_.front()) ? 1 : 0;  // markers are urgent records
      }
      records_.pop_front();
    }
    stats_.records_delivered += out.size() - markers;
    stats_.markers_delivered += markers;
    stats_.bytes_delivered += bytes;
    stats_.bytes_queued -= bytes;
    stats_.batches += out.empty() ? 0 : 1;
    streaming_ = !out.empty() && soon;
    std::vector<Record> spare = records_.TakeSpare();  // freed after the unlock
    lock.unlock();
    if (!out.empty()) not_full_.notify_all();
    return out;
  }

  void SetClosed(bool closed) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failure_.empty()) return;  // a failed queue stays closed
      if (closed_ && !closed) {
        admitted_ = next_ticket_;
        given_up_.clear();
      }
      closed_ = closed;
    }
    not_full_.notify_all();
    not_empty_.notify_all();
  }

  // Closes this queue for good: producers, waiting or future, fail with the reason.
  void Fail(const std::string& reason) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      failure_ = reason;
      closed_ = true;
    }
    not_full_.notify_all();
    not_empty_.notify_all();
  }

  // Why this queue refuses records: its failure, or that the receivers were stopped.
  std::string ClosedReason() {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_.empty() ? std::string(Responses::kStoppedMessage) : failure_;
  }

  // Wakes producers waiting for room, so that a larger budget takes effect at once.
  void Poke() { not_full_.notify_all(); }

  QueueStats Stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  void ResetPeak() {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.peak_bytes_queued = stats_.bytes_queued;
  }

 private:
  // A batch worth waking the receiver for (called under mu_).
  bool BatchReady() const {
    return closed_ || urgent_queued_ > 0 || stats_.producers_waiting > 0 ||
           records_.size() >= batch_records_ || stats_.bytes_queued >= batch_bytes_;
  }

  // Waits up to seconds for a batch worth waking for (BatchReady), while producers that find
  // this receiver gathering leave it asleep for anything less (called under mu_).
  void GatherFor(std::unique_lock<std::mutex>& lock, double seconds) {
    if (BatchReady()) return;
    coalescing_ += 1;
    not_empty_.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return BatchReady(); });
    coalescing_ -= 1;
  }

  // Tickets are admitted in order: the next one in line is admitted_ (called under mu_).
  void Admit(uint64_t ticket) {
    admitted_ = std::max(admitted_, ticket + 1);
    while (given_up_.erase(admitted_) > 0) admitted_ += 1;
  }

  // A ticket that leaves the line: admitted at once if it is next, skipped when its turn comes.
  void GiveUp(uint64_t ticket) {
    if (ticket < admitted_) return;
    if (ticket == admitted_) {
      Admit(ticket);
    } else {
      given_up_.insert(ticket);
    }
  }

  bool Fits(size_t size) const {
    return stats_.bytes_queued == 0 ||
           stats_.bytes_queued + size <= g_max_queue_bytes.load(std::memory_order_relaxed);
  }

  std::mutex mu_;
  std::condition_variable not_empty_, not_full_;
  RecordRing records_;
  uint64_t next_sequence_ = 0;
  uint64_t next_ticket_ = 0, admitted_ = 0;
  std::set<uint64_t> given_up_;  // tickets behind admitted_ whose producer stopped waiting
  bool closed_ = false;
  // Drains waiting (for a first record, or gathering a batch: coalescing_ of them).
  size_t receivers_waiting_ = 0, coalescing_ = 0;
  size_t urgent_queued_ = 0, batch_records_ = 1, batch_bytes_ = 1;
  // The last Pop handed out records that were there or came within its linger_s: more are
  // likely to come as soon.
  bool streaming_ = false;
  // The last coalescing wait gathered more records, or a Pop found several queued since.
  bool coalescing_pays_ = true;
  std::string failure_;
  QueueStats stats_;
};

// Keyed by (platform, the ordinal XLA hands the handler): the device's global id, 2048 and up
// on the second process of a multi-process CPU run, and the same small numbers on every
// platform. Queues are never freed: device threads may hold them.
using QueueKey = std::pair<std::string, int>;
struct QueueTable {
  std::mutex mu;
  std::map<QueueKey, DeviceQueue*> queues;
  bool closed = false;
};
QueueTable& g_queues = *new QueueTable();

constexpr char kNativePlatform[] = "cpu";  // where our FFI handlers are registered

DeviceQueue* LookUpQueue(const std::string& platform, int device) {
  std::lock_guard<std::mutex> lock(g_queues.mu);
  DeviceQueue*& q = g_queues.queues[{platform, device}];
  if (q == nullptr) {
    q = new DeviceQueue(device);
    if (g_queues.closed) q->SetClosed(true);
  }
  return q;
}

// The native handlers' lookup without a lock: queues live forever, so each is kept in a slot
// picked by its device id (a thread-local costs a call into the dynamic linker a tap). One
// process's ids (0 and up on the first, 2048 and up on the second on XLA's CPU client) fall in
// different slots; two that shared one would only take LookUpQueue's lock more often.
constexpr unsigned kNativeQueueSlots = 1024;
std::atomic<DeviceQueue*> g_native_queues[kNativeQueueSlots];

DeviceQueue* NativeQueueFor(int device) {
  std::atomic<DeviceQueue*>& slot =
      g_native_queues[static_cast<unsigned>(device) % kNativeQueueSlots];
  DeviceQueue* q = slot.load(std::memory_order_acquire);
  if (q == nullptr || q->device != device) {
    q = LookUpQueue(kNativePlatform, device);
    slot.store(q, std::memory_order_release);
  }
  return q;
}

// The record's sequence number, or DeviceQueue::kClosed or kTimedOut (WhyNotEnqueued says
// why: no message is built for a tap that went in). timeout_s bounds the wait for room (a
// `call`'s timeout; 0: forever). Throws bad_alloc when the record cannot be allocated; the
// record never leaks.
int64_t Enqueue(DeviceQueue* queue, int device, uint64_t consumer_id, ArrayViews arrays,
                uint16_t flags = 0, double timeout_s = 0, ffi::ThreadPool* pool = nullptr) {
  Record record = EncodeRecord(consumer_id, static_cast<uint32_t>(device), arrays, flags, pool);
  const bool expects_response = (flags & kFlagExpectsResponse) != 0;
  int64_t pushed = DeviceQueue::kClosed;
  try {
    pushed = queue->Push(record, expects_response,
                         expects_response || consumer_id == kBarrierMarkerId, timeout_s);
  } catch (...) {
    ReleaseRecord(record);
    throw;
  }
  if (pushed < 0) ReleaseRecord(record);
  return pushed;
}

std::string WhyNotEnqueued(DeviceQueue* queue, int64_t pushed, double timeout_s) {
  return pushed == DeviceQueue::kTimedOut
             ? TimeoutMessage(timeout_s) + " (its device's queue stayed full)"
             : queue->ClosedReason();
}

// What this thread gathered, if it drains, goes back to the pool now: before it enqueues from
// the host (so it reuses its own buffers first) and before it reports pool_stats().
void FlushOwnReleases() noexcept {
  if (t_drains) t_released.Flush();
}

// Sends a call record and waits for the answer; fills *response or says why it could not.
std::string CallHost(DeviceQueue* queue, int device, uint64_t consumer_id, ArrayViews arrays,
                     double timeout_s, Response* response) {
  // One timeout for the whole call: waiting for room in the queue, then for the answer.
  const auto start = std::chrono::steady_clock::now();
  const int64_t pushed =
      Enqueue(queue, device, consumer_id, arrays, kFlagExpectsResponse, timeout_s);
  if (pushed < 0) return WhyNotEnqueued(queue, pushed, timeout_s);
  double left = timeout_s;
  if (!WaitsForever(timeout_s)) {
    const double spent =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    left = std::max(timeout_s - spent, 1e-6);  // > 0: a spent timeout must not mean "forever"
  }
  return g_responses.Wait({queue, static_cast<uint64_t>(pushed)}, left, response, timeout_s);
}

// ---- the FFI handlers ------------------------------------------------------------------------

// The arrays to send: every operand but the ordering token, into out (room for args.size()).
ffi::Error CollectArrays(ffi::RemainingArgs& args, ArrayView* out, size_t* count) {
  *count = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> arg = args.get<ffi::AnyBuffer>(i);
    if (!arg.has_value()) return arg.error();
    ffi::AnyBuffer buffer = arg.value();
    if (buffer.element_type() == ffi::DataType::TOKEN) continue;
    auto dims = buffer.dimensions();
    out[(*count)++] = ArrayView{static_cast<uint8_t>(buffer.element_type()), dims.begin(),
                                dims.size(), buffer.untyped_data(), buffer.size_bytes()};
  }
  return ffi::Error::Success();
}

// Every handler's body runs inside this: a C++ exception (bad_alloc for a record larger than
// memory) becomes an FFI error that fails the computation with the reason, never a crash.
template <typename Body>
ffi::Error Guarded(Body body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return ffi::Error::Internal("hostcallback: out of host memory for a tap record");
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("hostcallback: ") + e.what());
  } catch (...) {
    return ffi::Error::Internal("hostcallback: unknown C++ exception in the tap handler");
  }
}

constexpr size_t kArraysOnStack = 16;

// emit_device >= 0: only that device enqueues (a whole-value tap lowered on every device).
ffi::Error TapImpl(int32_t device_ordinal, ffi::ThreadPool pool, uint64_t consumer_id,
                   int64_t emit_device, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  (void)rets;  // only the ordering token, which carries no data
  return Guarded([&]() -> ffi::Error {
    if (emit_device != -1 && emit_device != device_ordinal) return ffi::Error::Success();
    if (device_ordinal < 0) {
      return ffi::Error::Internal("hostcallback: negative device ordinal " +
                                  std::to_string(device_ordinal));
    }
    // On the stack for all but the widest taps: a tap allocates nothing but its record.
    ArrayView on_stack[kArraysOnStack];
    std::vector<ArrayView> on_heap;
    ArrayView* views = on_stack;
    if (args.size() > kArraysOnStack) {
      on_heap.resize(args.size());
      views = on_heap.data();
    }
    size_t count = 0;
    if (ffi::Error error = CollectArrays(args, views, &count); error.failure()) return error;
    DeviceQueue* queue = NativeQueueFor(device_ordinal);
    const int64_t pushed =
        Enqueue(queue, device_ordinal, consumer_id, ArrayViews(views, count), 0, 0, &pool);
    if (pushed < 0) return ffi::Error::Internal(WhyNotEnqueued(queue, pushed, 0));
    return ffi::Error::Success();
  });
}

// Why a shared call failed, by consumer id: written by the calling device, read by every device
// of the computation in HostcallbackCheck once the failure flag has reached them all.
struct CallFailures {
  std::mutex mu;
  std::map<uint64_t, std::string> by_consumer;
};
CallFailures& g_call_failures = *new CallFailures();

// Zeros in every output but the token.
ffi::Error ZeroOutputs(ffi::RemainingRets& rets) {
  for (size_t i = 0; i < rets.size(); ++i) {
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> ret = rets.get<ffi::AnyBuffer>(i);
    if (!ret.has_value()) return ret.error();
    ffi::AnyBuffer out = *ret.value();
    if (out.element_type() != ffi::DataType::TOKEN && out.size_bytes() > 0) {
      std::memset(out.untyped_data(), 0, out.size_bytes());
    }
  }
  return ffi::Error::Success();
}

// A shared call that timed out is said on stderr at once: its devices fail together only after
// the collective that follows, and where XLA's CPU client left a device out of a collective, XLA
// ends the process after its own rendezvous limit (40 s) before the error reaches Python.
void ReportSharedTimeout(const std::string& problem) {
  std::fprintf(stderr, "%s (a call shared over the devices of a sharded computation; every "
               "device fails with this error)\n", problem.c_str());
  std::fflush(stderr);
}

// A `call`: send the arrays, wait for the host's results, copy them into the outputs.
// emit_device != -1 (a call shared over the devices of a sharded computation): only that device
// calls and the others return zeros; the last output is a uint32 failure flag. The calling
// device must not fail on its own, since the others wait for it in the collective that shares
// its results: it returns zeros with the flag set and leaves the reason for HostcallbackCheck,
// which fails every device together after the collective.
ffi::Error CallImpl(int32_t device_ordinal, uint64_t consumer_id, int64_t emit_device,
                    double timeout_s, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return Guarded([&]() -> ffi::Error {
    const bool shared = emit_device != -1;
    if (shared && emit_device != device_ordinal) return ZeroOutputs(rets);
    std::string problem;
    Response response;
    if (device_ordinal < 0) {
      problem = "hostcallback: negative device ordinal " + std::to_string(device_ordinal);
    } else if (std::string bad = CheckTimeout(timeout_s); !bad.empty()) {
      problem = "hostcallback: " + bad;
    } else {
      try {
        std::vector<ArrayView> arrays(args.size());  // in the try: a shared call must not throw
        size_t count = 0;
        if (ffi::Error error = CollectArrays(args, arrays.data(), &count); error.failure()) {
          problem = "hostcallback: " + error.message();
        } else {
          problem = CallHost(NativeQueueFor(device_ordinal), device_ordinal, consumer_id,
                             ArrayViews(arrays.data(), count), timeout_s, &response);
          if (problem.empty()) problem = response.error;
        }
      } catch (const std::bad_alloc&) {
        if (!shared) throw;
        problem = "hostcallback: out of host memory for a call record";
      } catch (const std::exception& e) {
        if (!shared) throw;
        problem = std::string("hostcallback: ") + e.what();
      }
    }
    const size_t results = rets.size() - (shared ? 1 : 0);  // the flag comes last
    size_t next = 0;
    for (size_t i = 0; problem.empty() && i < results; ++i) {
      ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> ret = rets.get<ffi::AnyBuffer>(i);
      if (!ret.has_value()) return ret.error();
      ffi::AnyBuffer out = *ret.value();
      if (out.element_type() == ffi::DataType::TOKEN) continue;
      if (next >= response.results.size() || response.results[next].size() != out.size_bytes()) {
        problem = "hostcallback: the host's answer does not match the call's result shapes";
        break;
      }
      if (out.size_bytes() > 0) {
        std::memcpy(out.untyped_data(), response.results[next].data(), out.size_bytes());
      }
      ++next;
    }
    if (!shared) {
      return problem.empty() ? ffi::Error::Success() : ffi::Error::Internal(problem);
    }
    if (!problem.empty()) {
      if (problem.rfind(kTimeoutPrefix, 0) == 0) ReportSharedTimeout(problem);
      if (ffi::Error error = ZeroOutputs(rets); error.failure()) return error;
      std::lock_guard<std::mutex> lock(g_call_failures.mu);
      g_call_failures.by_consumer[consumer_id] = problem;
    } else {  // no reason of ours is left to be read for a failure elsewhere (another process)
      std::lock_guard<std::mutex> lock(g_call_failures.mu);
      g_call_failures.by_consumer.erase(consumer_id);
    }
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> flag = rets.get<ffi::AnyBuffer>(rets.size() - 1);
    if (!flag.has_value()) return flag.error();
    const uint32_t failed = problem.empty() ? 0 : 1;
    std::memcpy((*flag.value()).untyped_data(), &failed, sizeof(failed));
    return ffi::Error::Success();
  });
}

// After a shared call's results and failure flags were summed over the devices: fails with the
// call's reason when any device failed, else passes its operands (the flag, then the values)
// through.
ffi::Error CheckImpl(uint64_t consumer_id, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return Guarded([&]() -> ffi::Error {
    ffi::ErrorOr<ffi::AnyBuffer> flag = args.get<ffi::AnyBuffer>(0);
    if (!flag.has_value()) return flag.error();
    uint32_t failed = 0;
    std::memcpy(&failed, flag.value().untyped_data(), sizeof(failed));
    if (failed != 0) {
      std::lock_guard<std::mutex> lock(g_call_failures.mu);
      auto found = g_call_failures.by_consumer.find(consumer_id);
      return ffi::Error::Internal(
          found != g_call_failures.by_consumer.end()
              ? found->second
              : "hostcallback: the call failed on a device of another process (its log says why)");
    }
    for (size_t i = 0; i < rets.size(); ++i) {
      ffi::ErrorOr<ffi::AnyBuffer> in = args.get<ffi::AnyBuffer>(i);
      ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> ret = rets.get<ffi::AnyBuffer>(i);
      if (!in.has_value()) return in.error();
      if (!ret.has_value()) return ret.error();
      ffi::AnyBuffer out = *ret.value();
      if (out.size_bytes() != in.value().size_bytes()) {
        return ffi::Error::Internal("hostcallback: check operands and results differ");
      }
      if (out.size_bytes() > 0) {
        std::memcpy(out.untyped_data(), in.value().untyped_data(), out.size_bytes());
      }
    }
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostcallbackCall, CallImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<uint64_t>("consumer_id")
                                  .Attr<int64_t>("emit_device")
                                  .Attr<double>("timeout_s")
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostcallbackCheck, CheckImpl,
                              ffi::Ffi::Bind()
                                  .Attr<uint64_t>("consumer_id")
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostcallbackTap, TapImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<uint64_t>("consumer_id")
                                  .Attr<int64_t>("emit_device")
                                  .RemainingArgs()
                                  .RemainingRets());

// ---- the Python module ------------------------------------------------------------------------

namespace {

// Read-only: a consumer writing through a record's memory must not reach the pool.
using RecordArray = nb::ndarray<nb::numpy, const uint8_t, nb::ndim<1>>;
using ReadOnlyBytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

DeviceQueue* CheckedQueue(const std::string& platform, int device) {
  if (device < 0) throw nb::value_error("device ordinal must not be negative");
  if (platform.empty()) throw nb::value_error("platform must name a JAX platform, e.g. 'cpu'");
  return LookUpQueue(platform, device);
}

// Hands each record out as a read-only array owning it. Exception-safe: a record is owned by
// its capsule once wrapped; if wrapping one fails, it and every later record go back to the
// pool (ReleaseRecord) before the error propagates, so nothing leaks and the caller sees the
// error.
nb::list DrainRaw(int device, size_t max_records, size_t max_bytes, double timeout_s,
                  const std::string& platform) {
  if (std::string bad = CheckTimeout(timeout_s); !bad.empty()) throw nb::value_error(bad.c_str());
  DeviceQueue* queue = CheckedQueue(platform, device);
  // A batch in Python counts toward the memory bound: never more than one budget of bytes.
  max_bytes = std::min<uint64_t>(max_bytes, g_max_queue_bytes.load());
  std::vector<Record> records;
  {
    hostcallback::GilReleased released;
    ReturnReleased();
    records = queue->Pop(max_records, max_bytes, timeout_s);
  }
  size_t unowned = 0;  // records from here on are not owned by a capsule yet
  try {
    nb::list out;
    for (size_t i = 0; i < records.size(); ++i) {
      std::unique_ptr<Record> owned(new Record(records[i]));
      nb::capsule owner(owned.get(), [](void* p) noexcept {
        Record* record = static_cast<Record*>(p);
        ReleaseRecord(*record);
        delete record;
      });
      Record* record = owned.release();
      unowned = i + 1;  // the capsule releases this one, also if what follows throws
      size_t shape[1] = {record->size};
      out.append(RecordArray(record->data, 1, shape, owner));
    }
    return out;
  } catch (...) {
    for (size_t i = unowned; i < records.size(); ++i) ReleaseRecord(records[i]);
    throw;
  }
}

// ---- decoded drain ----------------------------------------------------------------------------

// numpy dtype objects by wire code, taken once from hostcallback.wire.DTYPE_BY_CODE (the one
// table of codes) and kept for the life of the process.
PyArray_Descr* g_dtypes[256] = {};
bool g_dtypes_loaded = false;

void LoadDtypes() {
  if (g_dtypes_loaded) return;
  nb::dict table = nb::borrow<nb::dict>(nb::module_::import_("hostcallback.wire").attr("DTYPE_BY_CODE"));
  for (auto [code, dtype] : table) {
    const int c = nb::cast<int>(code);
    if (c < 0 || c > 255) throw std::runtime_error("wire dtype code out of range");
    PyArray_Descr* descr = nullptr;
    if (!PyArray_DescrConverter(dtype.ptr(), &descr)) throw nb::python_error();
    g_dtypes[c] = descr;  // a new reference, kept forever
  }
  g_dtypes_loaded = true;
}

// Owns one drained record until the last array viewing it is gone, then returns it: a
// consumer that keeps one array keeps its own record alive, never its batch.
struct RecordOwner {
  explicit RecordOwner(const Record& r) : record(r) {
    g_records_held.fetch_add(1, std::memory_order_relaxed);
  }
  ~RecordOwner() {
    ReleaseRecord(record);
    g_records_held.fetch_sub(1, std::memory_order_relaxed);
  }
  Record record;
};

// The record's owner as a Python object. Throws with the record released.
nb::object CapsuleFor(const Record& r) {
  std::unique_ptr<RecordOwner> owner(new (std::nothrow) RecordOwner(r));
  if (!owner) {
    ReleaseRecord(r);
    throw std::bad_alloc();
  }
  nb::capsule capsule(owner.get(), [](void* p) noexcept { delete static_cast<RecordOwner*>(p); });
  owner.release();
  return capsule;
}

// Elements in an array of these dimensions, or -1 when one is negative or the count overflows.
int64_t ElementCount(const int64_t* dims, size_t ndim) {
  int64_t count = 1;
  for (size_t d = 0; d < ndim; ++d) {
    if (dims[d] < 0) return -1;
    if (dims[d] != 0 && count > INT64_MAX / dims[d]) return -1;
    count *= dims[d];
  }
  return count;
}

// count elements of itemsize bytes each, or -1 when that does not fit in 64 bits (a shape of
// 2^62 elements of 4 bytes must not wrap around to 0 bytes).
int64_t ByteCount(int64_t count, size_t itemsize) {
  int64_t bytes = 0;
  if (count < 0 || __builtin_mul_overflow(count, static_cast<int64_t>(itemsize), &bytes)) {
    return -1;
  }
  return bytes;
}

template <typename T>
T Get(const uint8_t* at) {
  T value;
  std::memcpy(&value, at, sizeof(T));
  return value;
}

// Takes a drained record's tuple out of the cycle collector's lists. Such a tuple holds only
// ints, a str or numpy arrays of numbers, none of which can refer back to it, so it can never be
// part of a cycle; CPython itself untracks such tuples, but only when a collection first walks
// them. Left tracked, a batch of 1,024 records made the collector walk and promote 2,048
// objects, and the full collections that promotion sets off took as long as the receiver's own
// Python: a fifth of its time.
void UntrackFromGc(PyObject* tuple) {
  if (PyObject_GC_IsTracked(tuple)) PyObject_GC_UnTrack(tuple);
}

// The arrays of one record, as a tuple of read-only numpy views whose base is `owner`. The
// record was built by EncodeRecord; every count, size and offset is still checked against the
// record's size, and each array's bytes against its shape, so that no view reaches outside it.
nb::tuple ArraysOf(const Record& r, PyObject* owner) {
  const uint32_t count = Get<uint32_t>(r.data + 20);
  const size_t header = Get<uint32_t>(r.data + 32);
  // Before the tuple is made: PyTuple_New writes every slot of what a corrupt count asks for.
  if (header < kFixedHeaderBytes || header > r.size ||
      count > (header - kFixedHeaderBytes) / kDescriptorBytes) {
    throw std::runtime_error("corrupt record header");
  }
  nb::tuple arrays = nb::steal<nb::tuple>(PyTuple_New(count));
  if (!arrays.is_valid()) throw nb::python_error();
  size_t at = kFixedHeaderBytes, offset = header;
  npy_intp dims[64];
  for (uint32_t i = 0; i < count; ++i) {
    if (at + kDescriptorBytes > header) throw std::runtime_error("corrupt record header");
    const uint8_t code = r.data[at];
    const uint16_t ndim = Get<uint16_t>(r.data + at + 2);
    const uint64_t byte_size = Get<uint64_t>(r.data + at + 8);
    if (ndim > 64) {
      throw std::runtime_error("an array of " + std::to_string(ndim) +
                               " dimensions; numpy makes arrays of at most 64");
    }
    if (at + kDescriptorBytes + 8 * ndim > header) throw std::runtime_error("corrupt record header");
    int64_t shape[64];
    for (uint16_t d = 0; d < ndim; ++d) {
      shape[d] = Get<int64_t>(r.data + at + kDescriptorBytes + 8 * d);
      dims[d] = static_cast<npy_intp>(shape[d]);
    }
    at += kDescriptorBytes + 8 * ndim;
    offset = AlignUp(offset);
    if (byte_size > r.size - std::min(offset, r.size)) {
      throw std::runtime_error("corrupt record: an array runs past its end");
    }
    PyArray_Descr* descr = g_dtypes[code];
    if (descr == nullptr) throw std::runtime_error("record with an unknown dtype code");
    const int64_t bytes = ByteCount(ElementCount(shape, ndim), PyDataType_ELSIZE(descr));
    if (bytes < 0 || static_cast<uint64_t>(bytes) != byte_size) {
      throw std::runtime_error("corrupt record: an array's shape does not match its bytes");
    }
    Py_INCREF(descr);  // stolen by PyArray_NewFromDescr
    PyObject* array = PyArray_NewFromDescr(&PyArray_Type, descr, ndim, dims, nullptr,
                                           r.data + offset, NPY_ARRAY_C_CONTIGUOUS, nullptr);
    if (array == nullptr) throw nb::python_error();
    PyArray_CLEARFLAGS(reinterpret_cast<PyArrayObject*>(array), NPY_ARRAY_WRITEABLE);
    Py_INCREF(owner);  // stolen by PyArray_SetBaseObject, even when it fails
    if (PyArray_SetBaseObject(reinterpret_cast<PyArrayObject*>(array), owner) < 0) {
      Py_DECREF(array);
      throw nb::python_error();
    }
    PyTuple_SET_ITEM(arrays.ptr(), i, array);
    offset += byte_size;
  }
  UntrackFromGc(arrays.ptr());
  return arrays;
}

// Waits like drain_raw(), then decodes in C++: returns (records, markers) where each record is
// (consumer_id, device, sequence, flags, arrays) in queue order and markers holds the values of
// the barrier markers of this batch (they never reach Python as records). arrays is a tuple of
// read-only views of the record, owned by one capsule per record; or, for a record that cannot
// be decoded, a str saying why, so that only its own consumer fails. Both tuples are left out
// of the cycle collector (UntrackFromGc). The markers are taken out before anything can fail,
// and every record is owned or released (ReleaseRecord) on every path.
// A drain's waiting windows (coalesce_s, linger_s) are bounded: 0 to 1 second.
void CheckWindow(const char* name, double seconds) {
  if (std::isnan(seconds) || seconds < 0 || seconds > 1) {
    throw nb::value_error((std::string(name) + " must be between 0 and 1 second").c_str());
  }
}

nb::tuple Drain(int device, size_t max_records, size_t max_bytes, double timeout_s,
                const std::string& platform, double coalesce_s, double linger_s) {
  if (std::string bad = CheckTimeout(timeout_s); !bad.empty()) throw nb::value_error(bad.c_str());
  CheckWindow("coalesce_s", coalesce_s);
  CheckWindow("linger_s", linger_s);
  DeviceQueue* queue = CheckedQueue(platform, device);
  LoadDtypes();  // before any record leaves the queue
  max_bytes = std::min<uint64_t>(max_bytes, g_max_queue_bytes.load());
  g_batch_bytes.store(max_bytes, std::memory_order_relaxed);
  std::vector<Record> records;
  {
    hostcallback::GilReleased released;
    ReturnReleased();
    records = queue->Pop(max_records, max_bytes, timeout_s, coalesce_s, linger_s);
  }
  // Barrier markers first, before any Python object is made.
  std::vector<uint64_t> marker_values;
  try {
    marker_values.reserve(records.size());
  } catch (...) {
    for (const Record& r : records) ReleaseRecord(r);
    throw;
  }
  size_t kept = 0;
  for (const Record& r : records) {
    if (Get<uint64_t>(r.data + 8) != kBarrierMarkerId) {
      records[kept++] = r;
      continue;
    }
    const size_t header = Get<uint32_t>(r.data + 32);
    marker_values.push_back(header + 8 <= r.size ? Get<uint64_t>(r.data + header) : 0);
    ReleaseRecord(r);
  }
  records.resize(kept);
  size_t unowned = 0;  // records from here on are neither owned by a capsule nor released
  try {
    nb::list markers;
    for (uint64_t m : marker_values) markers.append(m);
    nb::list out;
    for (size_t i = 0; i < records.size(); ++i) {
      const Record r = records[i];
      unowned = i + 1;
      nb::object owner = CapsuleFor(r);  // owns r from here, or has released it and thrown
      nb::object arrays;
      try {
        arrays = ArraysOf(r, owner.ptr());
      } catch (const std::exception& e) {  // nb::python_error too
        arrays = nb::str(e.what());
      }
      nb::tuple record = nb::make_tuple(Get<uint64_t>(r.data + 8), Get<uint32_t>(r.data + 16),
                                        Get<uint64_t>(r.data + kSequenceOffset),
                                        Get<uint16_t>(r.data + 6), std::move(arrays));
      UntrackFromGc(record.ptr());
      out.append(std::move(record));
    }
    return nb::make_tuple(out, markers);
  } catch (...) {
    for (size_t i = unowned; i < records.size(); ++i) ReleaseRecord(records[i]);
    throw;
  }
}

// The callback transport's way in: the same record, built from host arrays.
using HostLeaves = std::vector<std::tuple<int, std::vector<int64_t>, ReadOnlyBytes>>;

// Each leaf's dtype must be known and its bytes must be exactly what its shape holds: a record
// is decoded by its shapes, so a mismatch would let a view reach outside it.
std::vector<ArrayView> ViewsOf(const HostLeaves& leaves) {
  LoadDtypes();
  std::vector<ArrayView> arrays;
  for (const auto& [dtype, dims, bytes] : leaves) {
    if (dtype < 0 || dtype > 255 || g_dtypes[dtype] == nullptr) {
      throw nb::value_error(("unknown wire dtype code " + std::to_string(dtype)).c_str());
    }
    if (dims.size() > UINT16_MAX) throw nb::value_error("an array of more than 65535 dimensions");
    const int64_t byte_count =
        ByteCount(ElementCount(dims.data(), dims.size()), PyDataType_ELSIZE(g_dtypes[dtype]));
    if (byte_count < 0 || static_cast<uint64_t>(byte_count) != bytes.size()) {
      throw nb::value_error("an array's bytes do not match its shape and dtype");
    }
    arrays.push_back(ArrayView{static_cast<uint8_t>(dtype), dims.data(), dims.size(),
                               bytes.data(), bytes.size()});
  }
  return arrays;
}

void EnqueueFromHost(int device, uint64_t consumer_id, const HostLeaves& leaves,
                     const std::string& platform) {
  DeviceQueue* queue = CheckedQueue(platform, device);
  std::vector<ArrayView> arrays = ViewsOf(leaves);
  int64_t pushed;
  {
    hostcallback::GilReleased released;
    FlushOwnReleases();
    pushed = Enqueue(queue, device, consumer_id, arrays);
  }
  if (pushed < 0) throw std::runtime_error(WhyNotEnqueued(queue, pushed, 0));
}

// The callback transport's `call`: the same record and wait, from the device's Python callback.
nb::list CallFromHost(int device, uint64_t consumer_id, const HostLeaves& leaves,
                      double timeout_s, const std::string& platform) {
  if (std::string bad = CheckTimeout(timeout_s); !bad.empty()) throw nb::value_error(bad.c_str());
  DeviceQueue* queue = CheckedQueue(platform, device);
  std::vector<ArrayView> arrays = ViewsOf(leaves);
  Response response;
  std::string problem;
  {
    hostcallback::GilReleased released;
    FlushOwnReleases();
    problem = CallHost(queue, device, consumer_id, arrays, timeout_s, &response);
  }
  if (problem.empty()) problem = response.error;
  if (!problem.empty()) throw std::runtime_error(problem);
  nb::list out;
  for (const std::vector<uint8_t>& result : response.results) {
    out.append(nb::bytes(reinterpret_cast<const char*>(result.data()), result.size()));
  }
  return out;
}

void Respond(int device, uint64_t sequence, const std::vector<ReadOnlyBytes>& results,
             const std::string& platform) {
  DeviceQueue* queue = CheckedQueue(platform, device);
  Response response;
  for (const ReadOnlyBytes& result : results) {
    response.results.emplace_back(result.data(), result.data() + result.size());
  }
  g_responses.Set({queue, sequence}, std::move(response));
}

void RespondError(int device, uint64_t sequence, const std::string& message,
                  const std::string& platform) {
  DeviceQueue* queue = CheckedQueue(platform, device);
  Response response;
  response.error = message.empty() ? "hostcallback: the call failed on the host" : message;
  g_responses.Set({queue, sequence}, std::move(response));
}

nb::dict StatsOf(int device, const std::string& platform) {
  DeviceQueue* queue = CheckedQueue(platform, device);
  QueueStats s = queue->Stats();
  auto [calls_waiting, answers_unclaimed] = g_responses.Counts(queue);
  nb::dict d;
  d["records_enqueued"] = s.records_enqueued;
  d["bytes_enqueued"] = s.bytes_enqueued;
  d["records_delivered"] = s.records_delivered;
  d["barrier_markers_enqueued"] = s.markers_enqueued;
  d["barrier_markers_delivered"] = s.markers_delivered;
  d["bytes_delivered"] = s.bytes_delivered;
  d["bytes_queued"] = s.bytes_queued;
  d["peak_bytes_queued"] = s.peak_bytes_queued;
  d["waits"] = s.waits;
  d["wait_seconds"] = static_cast<double>(s.wait_ns) * 1e-9;
  d["producers_waiting"] = s.producers_waiting;
  d["batches"] = s.batches;
  d["receiver_wakeups"] = s.receiver_wakeups;
  d["calls_waiting"] = calls_waiting;
  d["answers_unclaimed"] = answers_unclaimed;
  return d;
}

void ResetPeak(int device, const std::string& platform) {
  CheckedQueue(platform, device)->ResetPeak();
}

void FailQueue(int device, const std::string& reason, const std::string& platform) {
  DeviceQueue* queue = CheckedQueue(platform, device);
  queue->Fail(reason);
  g_responses.Fail(queue, reason);
}

void SetAllClosed(bool closed) {
  std::lock_guard<std::mutex> lock(g_queues.mu);
  g_queues.closed = closed;
  for (auto& [key, q] : g_queues.queues) q->SetClosed(closed);
  g_responses.SetClosed(closed);  // calls still waiting for an answer fail instead of hanging
}

void SetMaxQueueBytes(uint64_t n) {
  if (n == 0) throw nb::value_error("max_queue_bytes must be positive");
  g_max_queue_bytes.store(n);
  std::lock_guard<std::mutex> lock(g_queues.mu);
  for (auto& [key, q] : g_queues.queues) q->Poke();
}

}  // namespace

// frames.cc: record-stream frames for the sinks, many records at once.
void DefineFrameFunctions(nb::module_& m);

NB_MODULE(_hostcallback_outfeed, m) {
  m.doc() = "hostcallback's native outfeed queues and XLA FFI handlers";
  if (_import_array() < 0) throw nb::python_error();
  hostcallback::RememberMainThread(nb::cast<unsigned long>(
      nb::module_::import_("threading").attr("main_thread")().attr("ident")));
  m.def("registrations", []() {
    nb::dict d;
    d["hostcallback_tap"] = nb::capsule(reinterpret_cast<void*>(HostcallbackTap));
    d["hostcallback_call"] = nb::capsule(reinterpret_cast<void*>(HostcallbackCall));
    d["hostcallback_check"] = nb::capsule(reinterpret_cast<void*>(HostcallbackCheck));
    return d;
  });
  m.def("drain", &Drain, nb::arg("device"), nb::arg("max_records"), nb::arg("max_bytes"),
        nb::arg("timeout_s"), nb::arg("platform") = kNativePlatform, nb::arg("coalesce_s") = 0.0,
        nb::arg("linger_s") = 0.0,
        "Waits (GIL released) up to timeout_s (0 or inf: forever) for records of one device, "
        "then up to coalesce_s more for a fuller batch (not when a call or barrier marker is "
        "queued, nor after such a wait gathered nothing until a burst comes); while records "
        "come less than linger_s apart, first up to linger_s for the next ones without their "
        "producers waking it; returns (records, markers): records as (consumer_id, device, "
        "sequence, flags, (read-only zero-copy numpy arrays)) in queue order, markers as the "
        "values of the batch's barrier markers. max_bytes is capped at the queue budget.");
  m.def("drain_raw", &DrainRaw, nb::arg("device"), nb::arg("max_records"), nb::arg("max_bytes"),
        nb::arg("timeout_s"), nb::arg("platform") = kNativePlatform,
        "Like drain, undecoded: a list of read-only uint8 arrays, one a record, each owning its "
        "memory (for hostcallback.wire.decode_record, the reference decoder).");
  m.def("enqueue", &EnqueueFromHost, nb::arg("device"), nb::arg("consumer_id"), nb::arg("leaves"),
        nb::arg("platform") = kNativePlatform,
        "Appends one record built from (dtype_code, dims, bytes) leaves; waits while the queue is full.");
  m.attr("CALL_TIMEOUT_PREFIX") = kTimeoutPrefix;
  m.def("call", &CallFromHost, nb::arg("device"), nb::arg("consumer_id"), nb::arg("leaves"),
        nb::arg("timeout_s"), nb::arg("platform") = kNativePlatform,
        "Enqueues a call record and waits (GIL released) for the host's answer: a list of bytes.");
  m.def("respond", &Respond, nb::arg("device"), nb::arg("sequence"), nb::arg("results"),
        nb::arg("platform") = kNativePlatform,
        "The receiver's answer to a call record: one uint8 array per result leaf.");
  m.def("respond_error", &RespondError, nb::arg("device"), nb::arg("sequence"), nb::arg("message"),
        nb::arg("platform") = kNativePlatform, "Fails the waiting call with this message.");
  m.def("stats", &StatsOf, nb::arg("device"), nb::arg("platform") = kNativePlatform);
  m.def("reset_peak_bytes_queued", &ResetPeak, nb::arg("device"),
        nb::arg("platform") = kNativePlatform,
        "Starts peak_bytes_queued again from what is queued now.");
  m.def("set_closed", &SetAllClosed, nb::arg("closed"),
        "Closed queues refuse new records and wake every waiter; what they hold can still be drained.");
  m.def("fail", &FailQueue, nb::arg("device"), nb::arg("reason"),
        nb::arg("platform") = kNativePlatform,
        "Its receiver is gone: every waiting and future tap or call on this queue fails with the "
        "reason; what it holds can still be drained.");
  m.def("set_max_queue_bytes", &SetMaxQueueBytes, nb::arg("max_queue_bytes"));
  m.def("max_queue_bytes", []() { return g_max_queue_bytes.load(); });
  m.def("pooled_bytes", []() { return g_pool.PooledBytes(); },
        "Bytes of free record buffers kept for reuse.");
  m.def("pool_stats", []() {
          FlushOwnReleases();  // this thread's released records count as pooled
          return g_pool.Stats();
        },
        "The buffer pool: pooled_bytes (free), in_use_bytes, hits and misses, records_held. "
        "in_use_bytes includes small records a receiver released since its last drain.");
  DefineFrameFunctions(m);
  m.attr("NATIVE_PLATFORM") = kNativePlatform;
  m.attr("WIRE_VERSION") = kVersion;
}
