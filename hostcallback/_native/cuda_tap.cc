// The GPU tap. On the launching thread it reserves the record's room in its device's queue (a
// full queue makes the launch wait: nothing is dropped), writes the header into a page-locked
// buffer, queues one asynchronous device-to-host copy per array on the stream and records an
// event after them; the device's committer (cuda_commit.h) joins the record to the queue once
// that event has completed, in launch order. The stream never waits for a tap: no
// synchronisation, no host function, no GIL, no Python. Where the pinned pool is spent, the
// record takes pageable memory, whose copy returns only once the stream got there. A
// computation's fence (HostcallbackFenceCuda) is the one place the stream waits: for a value the
// committer writes once the receiver has handled the computation's taps.

#include "cuda_tap.h"

#include <atomic>
#include <cstdio>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "buffer_pool.h"
#include "constants.h"
#include "cuda_commit.h"
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

// The pinned pool is spent, so GPU taps make their launches wait.
std::atomic<bool> g_said_pageable{false};
constexpr char kPageableFallback[] =
    "hostcallback: GPU taps now copy into pageable memory, which makes each launch wait for its "
    "stream: the page-locked buffers (at most twice the queue budget) are all in use, held by "
    "queued records or by arrays a consumer kept (hostcallback._native.outfeed.pinned_stats())";

// Room reserved in a queue, given back unless handed to the committer.
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
    // A tap captured into a CUDA graph would copy into its one record at every replay, which
    // the committer hears of once: XLA keeps this handler out of command buffers (it declares
    // no trait that allows them), and a stream captured otherwise is refused.
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
    CudaCommitter& committer = CommitterFor(*driver, device);
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
    // The event after the copies; on failure a copy already queued may still write into the
    // buffer, which is then never reused (left allocated). The room goes back with the reservation.
    cuda::Event event = nullptr;
    cuda::Result evented = committer.TakeEvent(&event);
    if (static_cast<int>(evented) == 0) {
      try {
        evented = committer.RecordAndHand(
            stream, PendingRecord{queue, record, size, event, context.context(), !failure.empty()});
      } catch (const std::bad_alloc&) {
        if (!copying) ReleaseRecord(record);
        throw;
      }
    }
    if (static_cast<int>(evented) != 0) {
      if (!copying) ReleaseRecord(record);
      return ffi::Error::Internal(cuda::Describe(*driver, "recording a GPU tap's event", evented));
    }
    reservation.HandOver();  // the committer's now, with the record
    if (!failure.empty()) return ffi::Error::Internal(failure);
    return ffi::Error::Success();
  } catch (const std::bad_alloc&) {
    return ffi::Error::Internal("hostcallback: out of host memory for a GPU tap record");
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("hostcallback: ") + e.what());
  }
}

ffi::Error BeginCudaImpl(cuda::Stream stream, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  (void)args;  // only the token that orders it
  try {
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
        return ffi::Error::Internal(
            cuda::Describe(*driver, "a tapped computation's begin", zeroed));
      }
    }
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("hostcallback: a tapped computation's begin: ") +
                                e.what());
  }
}

ffi::Error FenceCudaImpl(cuda::Stream stream, int32_t ordinal, ffi::RemainingArgs args,
                         ffi::RemainingRets rets) {
  (void)args;  // the taps' tokens, the begin's id and a weight: the stream orders it after them
  (void)rets;  // a token
  if (ordinal < 0) return ffi::Error::Success();
  // A fork's child has no committer to let the stream go on.
  if (InForkedChild()) return ffi::Error::Internal(kForkedMessage);
  try {
    const cuda::Driver* driver = nullptr;
    if (ffi::Error error = WithDriver(&driver); error.failure()) return error;
    StreamContext context(*driver, stream);
    const int device = GlobalIdOf(ordinal);
    const cuda::Result queued =
        CommitterFor(*driver, device).QueueFence(stream, GpuQueueFor(device));
    if (static_cast<int>(queued) != 0) {
      return ffi::Error::Internal(
          cuda::Describe(*driver, "queuing a tapped computation's fence", queued));
    }
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("hostcallback: a tapped computation's fence: ") +
                                e.what());
  }
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
