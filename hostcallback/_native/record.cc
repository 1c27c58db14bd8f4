// Encodes one tap record: the header, the array descriptors and the arrays' bytes, copying large
// arrays on several of XLA's threads. Runs on the device thread; no Python, no GIL.

#include "record.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <new>
#include <thread>
#include <vector>

#include "buffer_pool.h"
#include "xla/ffi/api/ffi.h"

namespace hostcallback {

namespace ffi = xla::ffi;

namespace {

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

// memcpy, for a large array on several threads: those of `pool` (the FFI handlers'), or without
// a pool (a record from Python: the callback transport) one thread started for the copy.
void CopyArray(uint8_t* dst, const uint8_t* src, size_t bytes, ffi::ThreadPool* pool) {
  // More threads than cores only take turns (forced CPU devices share one pool of 4 on 2 cores).
  static const size_t cores = std::max(1u, std::thread::hardware_concurrency());
  const size_t threads = bytes < kParallelCopyBytes ? 1
                         : pool != nullptr          ? static_cast<size_t>(pool->num_threads())
                                                    : 2;
  if (threads < 2 || cores < 2) {
    std::memcpy(dst, src, bytes);
    return;
  }
  auto copy = std::make_shared<ChunkedCopy>(dst, src, bytes);
  const size_t helpers = std::min({threads, cores, copy->chunks}) - 1;
  for (size_t i = 0; i < helpers; ++i) {
    try {
      if (pool != nullptr) {
        pool->Schedule([copy]() noexcept { copy->CopyChunks(); });
      } else {
        std::thread([copy]() noexcept { copy->CopyChunks(); }).detach();
      }
    } catch (...) {  // no memory or no thread for the helper: this thread copies what is left
      break;
    }
  }
  copy->CopyChunks();
  while (copy->done.load(std::memory_order_acquire) < copy->chunks) std::this_thread::yield();
}

// ---- encoding ---------------------------------------------------------------------------------

// Zeroes n bytes (a multiple of kAlignment) a line at a time: at -O3 a fixed-size memset
// compiles to a few vector stores, where a variable one (or any, at -Os: see CMakeLists.txt) is
// a `rep stos` whose start-up costs a small tap a quarter of its enqueue.
void ZeroLines(uint8_t* at, size_t n) {
  for (size_t i = 0; i < n; i += kAlignment) std::memset(at + i, 0, kAlignment);
}

}  // namespace

size_t RecordSize(ArrayViews arrays, size_t* header_size) {
  size_t header = kFixedHeaderBytes;
  for (const ArrayView& a : arrays) header += kDescriptorBytes + 8 * a.ndim;
  header = AlignUp(header);
  size_t size = header;
  for (const ArrayView& a : arrays) size = AlignUp(size) + a.byte_size;
  *header_size = header;
  return AlignUp(std::max<size_t>(size, kAlignment));
}

void WriteHeader(uint8_t* data, size_t size, size_t header_size, uint64_t consumer_id,
                 uint32_t device, ArrayViews arrays, uint16_t flags, size_t* offsets) {
  ZeroLines(data, header_size);
  Put<uint32_t>(data + 0, kMagic);
  Put<uint16_t>(data + 4, kVersion);
  Put<uint16_t>(data + kFlagsOffset, flags);
  Put<uint64_t>(data + kConsumerIdOffset, consumer_id);
  Put<uint32_t>(data + kDeviceOffset, device);
  Put<uint32_t>(data + kArrayCountOffset, static_cast<uint32_t>(arrays.size()));
  Put<uint64_t>(data + kSequenceOffset, 0);  // set when the record joins its queue
  Put<uint32_t>(data + kHeaderSizeOffset, static_cast<uint32_t>(header_size));
  Put<uint32_t>(data + 36, 0);  // reserved
  Put<uint64_t>(data + kRecordSizeOffset, size);
  uint8_t* at = data + kFixedHeaderBytes;
  size_t offset = header_size;
  size_t i = 0;
  for (const ArrayView& a : arrays) {
    Put<uint8_t>(at + 0, a.dtype);
    Put<uint16_t>(at + 2, static_cast<uint16_t>(a.ndim));
    Put<uint64_t>(at + 8, a.byte_size);
    for (size_t d = 0; d < a.ndim; ++d) Put<int64_t>(at + 16 + 8 * d, a.dims[d]);
    at += kDescriptorBytes + 8 * a.ndim;
    offset = AlignUp(offset);
    // The padding after an array lies in its last line: zeroed here, the array copied over it.
    if (a.byte_size > 0) ZeroLines(data + AlignUp(offset + a.byte_size) - kAlignment, kAlignment);
    offsets[i++] = offset;
    offset += a.byte_size;
  }
  // size is AlignUp(offset) (RecordSize's sum): the last array's line ends the record.
}

Record EncodeRecord(uint64_t consumer_id, uint32_t device, ArrayViews arrays, uint16_t flags,
                    ffi::ThreadPool* pool) {
  size_t header = 0;
  const size_t size = RecordSize(arrays, &header);
  Record r;
  r.data = g_pool.Get(size, &r.capacity, &r.outside_pool);
  if (r.data == nullptr) throw std::bad_alloc();
  r.size = size;
  // Offsets on the stack for all but the widest records: a tap allocates nothing but its record.
  constexpr size_t kOnStack = 16;
  size_t on_stack[kOnStack];
  std::vector<size_t> on_heap;
  size_t* offsets = on_stack;
  if (arrays.size() > kOnStack) {
    try {
      on_heap.resize(arrays.size());
    } catch (...) {
      g_pool.Put(r.data, r.capacity, r.outside_pool);
      throw;
    }
    offsets = on_heap.data();
  }
  WriteHeader(r.data, size, header, consumer_id, device, arrays, flags, offsets);
  size_t i = 0;
  for (const ArrayView& a : arrays) {
    if (a.byte_size > 0) {
      CopyArray(r.data + offsets[i], static_cast<const uint8_t*>(a.data), a.byte_size, pool);
    }
    ++i;
  }
  return r;
}

}  // namespace hostcallback
