// The GPU tap. On the launching thread it reserves the record's room in its device's queue (a
// full queue makes the launch wait: nothing is dropped), writes the header into a page-locked
// buffer and queues one asynchronous device-to-host copy per array on the stream; then a host
// function on the same stream joins the record to the queue once the copies are done, in stream
// order. The stream never waits for a tap: no synchronisation, no GIL, no Python. Its host
// function never blocks and never calls CUDA (the driver forbids it there). Where the pinned pool
// is spent, the record takes pageable memory, whose copy returns only once the stream got there.
// A computation's fence (HostcallbackFenceCuda) is the one host function that blocks.

#include "cuda_tap.h"

#include <atomic>
#include <cstdio>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "buffer_pool.h"
#include "constants.h"
#include "cuda_driver.h"
#include "device_queue.h"
#include "ffi_arrays.h"
#include "pinned_pool.h"
#include "record.h"
#include "xla/ffi/api/ffi.h"

namespace hostcallback {

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxOrdinals = 1024;
std::atomic<int> g_cuda_ids[kMaxOrdinals];  // global id + 1 per ordinal; 0: the ordinal itself

int GlobalIdOf(int ordinal) {
  const int id = ordinal < kMaxOrdinals ? g_cuda_ids[ordinal].load(std::memory_order_relaxed) : 0;
  return id > 0 ? id - 1 : ordinal;
}

// A record on its way: its copies are queued on the stream, and the host function after them
// joins it to the queue (or, where queuing a copy failed, gives it and its room back).
struct PendingRecord {
  DeviceQueue* queue;
  Record record;
  uint64_t reserved;
  bool failed;
};

// Says `message` on stderr the first time `said` is found unset.
void SayOnce(std::atomic<bool>& said, const char* message) noexcept {
  if (said.exchange(true)) return;
  std::fprintf(stderr, "%s\n", message);
  std::fflush(stderr);
}

// A GPU tap lost because its queue closed between its launch and its copy.
std::atomic<bool> g_said_lost_after_close{false};
constexpr char kLostAfterClose[] =
    "hostcallback: a GPU tap reached its device's queue after the receivers were stopped, and "
    "was not delivered (stop_outfeed_receiver() waits for the taps dispatched before it; this "
    "one was dispatched as it stopped)";

// The pinned pool is spent, so GPU taps make their launches wait.
std::atomic<bool> g_said_pageable{false};
constexpr char kPageableFallback[] =
    "hostcallback: GPU taps now copy into pageable memory, which makes each launch wait for its "
    "stream: the page-locked buffers (at most twice the queue budget) are all in use, held by "
    "queued records or by arrays a consumer kept (hostcallback._native.outfeed.pinned_stats())";

// The host function: on CUDA's own thread, after the record's copies. Never blocks, never
// calls CUDA.
void JoinQueue(void* user_data) noexcept {
  PendingRecord* pending = static_cast<PendingRecord*>(user_data);
  DeviceQueue* queue = pending->queue;
  const bool marker = IsBarrierMarker(pending->record);
  if (pending->failed) {
    ReleaseRecord(pending->record);
    queue->CancelReservation(pending->reserved);
  } else {
    int64_t joined = DeviceQueue::kClosed;
    try {
      joined = queue->Commit(pending->record, pending->reserved);
    } catch (...) {  // no memory for the queue's ring: fail the queue, loudly, not the record
      static const std::string kNoMemory =
          "hostcallback: out of host memory for a GPU tap's place in its queue";
      queue->Fail(kNoMemory);
    }
    if (joined < 0) {
      ReleaseRecord(pending->record);
      if (!marker && !DropAtExit()) SayOnce(g_said_lost_after_close, kLostAfterClose);
    }
  }
  delete pending;
}

// Room reserved in a queue, given back unless handed to the host function.
class Reservation {
 public:
  Reservation(DeviceQueue* queue, uint64_t bytes) : queue_(queue), bytes_(bytes) {}
  ~Reservation() {
    if (queue_ != nullptr) queue_->CancelReservation(bytes_);
  }
  void HandOver() { queue_ = nullptr; }
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;

 private:
  DeviceQueue* queue_;
  uint64_t bytes_;
};

// What went wrong on the stream while a launch waited for room, or "" while it runs on.
std::string StreamFailure(const cuda::Driver& driver, cuda::Stream stream) {
  const cuda::Result state = driver.stream_query(stream);
  if (static_cast<int>(state) == 0 || static_cast<int>(state) == cuda::kErrorNotReady) return "";
  return cuda::Describe(driver, "the GPU's stream, while a tap waited for room in its queue,",
                        state);
}

// The driver, or an FFI error saying why there is none.
ffi::Error WithDriver(const cuda::Driver** driver) {
  std::string why;
  *driver = cuda::GetDriver(&why);
  return *driver != nullptr ? ffi::Error::Success() : ffi::Error::Internal(why);
}

ffi::Error TapCudaImpl(cuda::Stream stream, int32_t ordinal, uint64_t consumer_id,
                       int64_t emit_device, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  (void)rets;  // only the ordering token
  try {
    if (ordinal < 0) {
      return ffi::Error::Internal("hostcallback: negative device ordinal " +
                                  std::to_string(ordinal));
    }
    const int device = GlobalIdOf(ordinal);
    if (emit_device != kAllDevices && emit_device != device) return ffi::Error::Success();
    if (InForkedChild()) return ffi::Error::Internal(kForkedMessage);
    const cuda::Driver* driver = nullptr;
    if (ffi::Error error = WithDriver(&driver); error.failure()) return error;
    StreamContext context(*driver, stream);
    // A host function captured into a CUDA graph would run its one record at every replay: XLA
    // keeps this handler out of command buffers (it declares no trait that allows them), and a
    // stream captured otherwise is refused.
    cuda::CaptureStatus capture{};
    if (static_cast<int>(driver->stream_is_capturing(stream, &capture)) == 0 &&
        static_cast<int>(capture) != cuda::kStreamCaptureStatusNone) {
      return ffi::Error::Internal(
          "hostcallback: a GPU tap cannot run in a CUDA graph being captured");
    }

    std::vector<ArrayView> arrays(args.size());
    size_t count = 0;
    if (ffi::Error error = CollectArrays(args, arrays.data(), &count); error.failure()) {
      return error;
    }
    arrays.resize(count);
    size_t header = 0;
    const size_t size = RecordSize(ArrayViews(arrays), &header);
    std::vector<size_t> offsets(arrays.size());
    auto pending = std::make_unique<PendingRecord>();  // allocated before any room is held

    DeviceQueue* queue = GpuQueueFor(device);
    std::string stream_failure;
    const int64_t reserved = queue->Reserve(size, [&] {
      stream_failure = StreamFailure(*driver, stream);
      return !stream_failure.empty();
    });
    if (reserved == DeviceQueue::kClosed) {
      if (consumer_id != kBarrierMarkerId && DropAtExit()) return ffi::Error::Success();
      return ffi::Error::Internal(queue->ClosedReason());
    }
    if (reserved == DeviceQueue::kWatchFailed) return ffi::Error::Internal(stream_failure);
    if (reserved < 0) return ffi::Error::Internal(WhyNotEnqueued(queue, reserved, 0));
    Reservation reservation(queue, size);

    Record record;
    record.size = size;
    record.data = g_pinned_pool.Get(*driver, size, &record.capacity);
    record.pinned = record.data != nullptr;
    if (!record.pinned) {
      SayOnce(g_said_pageable, kPageableFallback);
      record.data = g_pool.Get(size, &record.capacity, &record.outside_pool);
      if (record.data == nullptr) throw std::bad_alloc();
    }
    WriteHeader(record.data, size, header, consumer_id, static_cast<uint32_t>(device),
                ArrayViews(arrays), 0, offsets.data());
    std::string failure;
    bool copying = false;  // a copy was queued: the buffer is the stream's until it is done
    for (size_t i = 0; i < arrays.size() && failure.empty(); ++i) {
      if (arrays[i].byte_size == 0) continue;
      const cuda::Result copied = driver->memcpy_dtoh_async(
          record.data + offsets[i], reinterpret_cast<cuda::DevicePtr>(arrays[i].data),
          arrays[i].byte_size, stream);
      if (static_cast<int>(copied) != 0) {
        failure = cuda::Describe(*driver, "a GPU tap's device-to-host copy", copied);
      } else {
        copying = true;
      }
    }
    *pending = PendingRecord{queue, record, size, !failure.empty()};
    const cuda::Result launched = driver->launch_host_func(stream, JoinQueue, pending.get());
    if (static_cast<int>(launched) != 0) {
      // A copy already queued may still write into the buffer: then it is never reused (left
      // allocated); the room goes back with the reservation.
      if (!copying) ReleaseRecord(record);
      return ffi::Error::Internal(
          cuda::Describe(*driver, "queuing a GPU tap's host function", launched));
    }
    pending.release();  // JoinQueue's now, with the room
    reservation.HandOver();
    if (!failure.empty()) return ffi::Error::Internal(failure);
    return ffi::Error::Success();
  } catch (const std::bad_alloc&) {
    return ffi::Error::Internal("hostcallback: out of host memory for a GPU tap record");
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("hostcallback: ") + e.what());
  }
}

// The fence's host function: waits until the receiver has handled every record that joined the
// queue before it, which on this stream is every tap of the computation (their host functions ran
// first). The one host function that blocks, and only on the receiver, never on CUDA work: a
// consumer stuck in one batch for kTapPatienceSeconds lets it go on (AwaitTaps), since that
// consumer may be waiting for this very stream. A failed queue ends the wait; the barrier says why.
void AwaitHandled(void* queue) noexcept {
  static_cast<DeviceQueue*>(queue)->AwaitTaps(kTapPatienceSeconds);
}

ffi::Error BeginCudaImpl(cuda::Stream stream, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  (void)args;  // only the token that orders it
  const cuda::Driver* driver = nullptr;
  if (ffi::Error error = WithDriver(&driver); error.failure()) return error;
  StreamContext context(*driver, stream);
  for (size_t i = 0; i < rets.size(); ++i) {
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> ret = rets.get<ffi::AnyBuffer>(i);
    if (!ret.has_value()) return ret.error();
    ffi::AnyBuffer out = *ret.value();
    if (out.element_type() != ffi::DataType::U32) continue;
    const cuda::Result zeroed = driver->memset_d32_async(
        reinterpret_cast<cuda::DevicePtr>(out.untyped_data()), 0, 1, stream);
    if (static_cast<int>(zeroed) != 0) {
      return ffi::Error::Internal(cuda::Describe(*driver, "a tapped computation's begin", zeroed));
    }
  }
  return ffi::Error::Success();
}

ffi::Error FenceCudaImpl(cuda::Stream stream, int32_t ordinal, ffi::RemainingArgs args,
                         ffi::RemainingRets rets) {
  (void)args;  // the taps' tokens, the begin's id and a weight: the stream orders it after them
  (void)rets;  // a token
  if (ordinal < 0) return ffi::Error::Success();
  const cuda::Driver* driver = nullptr;
  if (ffi::Error error = WithDriver(&driver); error.failure()) return error;
  StreamContext context(*driver, stream);
  DeviceQueue* queue = GpuQueueFor(GlobalIdOf(ordinal));
  const cuda::Result launched = driver->launch_host_func(stream, AwaitHandled, queue);
  if (static_cast<int>(launched) != 0) {
    return ffi::Error::Internal(
        cuda::Describe(*driver, "queuing a tapped computation's fence", launched));
  }
  return ffi::Error::Success();
}

}  // namespace

void SetCudaDeviceIds(const std::vector<int>& ids) {
  for (size_t ordinal = 0; ordinal < ids.size() && ordinal < kMaxOrdinals; ++ordinal) {
    g_cuda_ids[ordinal].store(ids[ordinal] + 1, std::memory_order_relaxed);
  }
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostcallbackTapCuda, TapCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cuda::Stream>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<uint64_t>("consumer_id")
                                  .Attr<int64_t>("emit_device")
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    HostcallbackBeginCuda, BeginCudaImpl,
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cuda::Stream>>().RemainingArgs().RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostcallbackFenceCuda, FenceCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cuda::Stream>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets());

}  // namespace hostcallback
