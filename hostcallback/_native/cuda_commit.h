// GPU tap records on their way to their queue, and the ends of GPU computations that wait for
// them. A GPU tap queues its record's copies on the stream and records an event after them; its
// device's committer, a thread of its own, waits for the events in the order they were recorded
// (the stream's order) and joins each record to its queue once its event has completed. The
// stream never waits for a tap: an event costs it about 2 us where a host function
// (cuLaunchHostFunc) held it about 30 us (docs/performance.md, "On a GPU").
//
// A computation's fence makes its stream wait, on the GPU, for a value in page-locked memory
// (cuStreamWaitValue32) that the committer writes once it has joined every record before the
// fence and the receiver has handled them. No host function blocks: CUDA runs a process's host
// functions one at a time on a thread of its own, which a waiting one would hold for others.
#ifndef HOSTCALLBACK_NATIVE_CUDA_COMMIT_H_
#define HOSTCALLBACK_NATIVE_CUDA_COMMIT_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <mutex>
#include <vector>

#include "cuda_driver.h"
#include "device_queue.h"
#include "record.h"

namespace hostcallback {

// A record whose copies are queued on a stream, to join `queue` under `reserved` bytes once
// `event` has completed. `failed`: a copy could not be queued, so the record is given back (with
// its room) instead of joining.
struct PendingRecord {
  DeviceQueue* queue = nullptr;
  Record record;
  uint64_t reserved = 0;
  cuda::Event event = nullptr;
  cuda::Context context = nullptr;
  bool failed = false;
};

class CudaCommitter {
 public:
  // Starts the committer's thread, which lives as long as the process.
  explicit CudaCommitter(const cuda::Driver& driver);

  // On a thread with the stream's context current: an event to record after a record's copies
  // (one the committer is done with, or a new one).
  cuda::Result TakeEvent(cuda::Event* event);

  // Records pending.event on the stream and hands the record over: the committer joins it (or
  // gives it back) once the event has completed. On an error the record stays the caller's and
  // the event goes back; throws bad_alloc with nothing recorded or handed.
  cuda::Result RecordAndHand(cuda::Stream stream, const PendingRecord& pending);

  // On a thread with the stream's context current: makes the stream wait until every record
  // handed over before it has joined `queue` and the receiver has handled it, or the receiver
  // has been stuck in one batch for kTapPatienceSeconds (DeviceQueue::AwaitTaps). On an error
  // the stream does not wait; throws bad_alloc with nothing queued.
  cuda::Result QueueFence(cuda::Stream stream, DeviceQueue* queue);

 private:
  // What the committer's thread takes in turn: a record, or a fence and the value that lets its
  // stream go on.
  struct Entry {
    PendingRecord pending;
    bool is_fence = false;
    uint32_t fence_value = 0;
  };

  void Run();
  // One entry's turn: a record waits for its event and joins (Finish); a fence waits for the
  // receiver and writes its value.
  void Take(const Entry& entry, cuda::Context* current);
  // Joins the record to its queue, or gives it back (with its room) where it failed or the event
  // says the stream did.
  void Finish(const PendingRecord& pending, cuda::Result waited);
  // Appends an entry made beforehand (a list of one), which cannot fail.
  void Append(std::list<Entry>& entry);

  const cuda::Driver& driver_;
  // Held by launching threads from their operation on the stream until its entry is appended, so
  // that the committer's order is the stream's even where several threads launch on it. The
  // committer never takes it: a call on the stream may wait for the GPU, which may be waiting
  // for the committer (a fence).
  std::mutex launch_mu_;
  // Guards entries_ and free_events_, held only briefly and never across a CUDA call.
  std::mutex mu_;
  std::condition_variable queued_cv_;
  std::list<Entry> entries_;
  std::vector<cuda::Event> free_events_;
  // The word fences wait on (page-locked, seen by the GPU at fence_word_on_device_), made at the
  // first fence; the value the last fence queued waits for (under launch_mu_).
  uint32_t* fence_word_ = nullptr;
  cuda::DevicePtr fence_word_on_device_ = 0;
  uint32_t last_fence_ = 0;
};

// Says `message` on stderr the first time `said` is found unset.
void SayOnce(std::atomic<bool>& said, const char* message) noexcept;

// The committer of the GPU device with this global id: made (its thread started) on first use,
// never freed. Throws where no thread can be started.
CudaCommitter& CommitterFor(const cuda::Driver& driver, int device);

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_CUDA_COMMIT_H_
