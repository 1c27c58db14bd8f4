// One tap record: its bytes (layout in docs/wire-format.md and hostcallback/_records/wire.py) and
// how they are built from the tapped arrays.
#ifndef HOSTCALLBACK_NATIVE_RECORD_H_
#define HOSTCALLBACK_NATIVE_RECORD_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "constants.h"

namespace xla::ffi {
class ThreadPool;  // xla/ffi/api/ffi.h: XLA's intra-op threads, which copy large arrays
}  // namespace xla::ffi

namespace hostcallback {

inline size_t AlignUp(size_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

template <typename T>
void Put(uint8_t* at, T value) {
  std::memcpy(at, &value, sizeof(T));
}

template <typename T>
T Get(const uint8_t* at) {
  T value;
  std::memcpy(&value, at, sizeof(T));
  return value;
}

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

// A record's bytes, 64-byte aligned. Its size lives here, outside the bytes, so that nothing
// written into a record can change how much memory is returned (or reused) for it. capacity is
// what was allocated (a pool size class), size what the record uses and the budget counts.
// Record::run_id where the handler that made the record does not know its XLA execution.
inline constexpr int64_t kUnknownRun = -1;

struct Record {
  uint8_t* data = nullptr;
  size_t size = 0;
  size_t capacity = 0;
  bool outside_pool = false;  // larger than the pool could keep: freed, never pooled
  bool pinned = false;        // page-locked memory of the pinned pool (a GPU tap, cuda_tap.cc)
  bool urgent = false;        // a call or a barrier marker: its queue wakes the receiver at once
  // The XLA execution whose tap made it (FFI's RunId): tells the computation that made it apart
  // whichever thread XLA ran the tap on (RunningComputations::OfRun).
  int64_t run_id = kUnknownRun;
  // Bytes of arrays the record stands for that are held elsewhere (a tap handed over in Python,
  // kFlagHandedOverInPython): its queue's budget counts them with the record's own.
  uint64_t held_bytes = 0;
};

// What a record weighs against its queue's byte budget.
inline uint64_t BudgetBytes(const Record& record) { return record.size + record.held_bytes; }

// Whether a record is a barrier marker (consumer id kBarrierMarkerId, at byte 8 of its header).
inline bool IsBarrierMarker(const Record& record) {
  return Get<uint64_t>(record.data + kConsumerIdOffset) == kBarrierMarkerId;
}

// Builds the record in a buffer from the pool; every byte that is not a field or an array
// element is zero (padding included), so a recycled buffer never carries an earlier record's
// bytes. Throws bad_alloc. A pool (XLA's intra-op threads) copies large arrays on several
// threads. The record is the caller's, to queue or to give back (ReleaseRecord).
Record EncodeRecord(uint64_t consumer_id, uint32_t device, ArrayViews arrays, uint16_t flags = 0,
                    xla::ffi::ThreadPool* pool = nullptr);

// The size of the record of these arrays, and of its header (where the first array begins).
size_t RecordSize(ArrayViews arrays, size_t* header_size);

// Writes a record's header (the sequence number left 0) and zeroes every byte of `data` that no
// array element will cover; offsets[i] receives where array i's bytes go (room for
// arrays.size()). The arrays' bytes are the caller's to copy.
void WriteHeader(uint8_t* data, size_t size, size_t header_size, uint64_t consumer_id,
                 uint32_t device, ArrayViews arrays, uint16_t flags, size_t* offsets);

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_RECORD_H_
