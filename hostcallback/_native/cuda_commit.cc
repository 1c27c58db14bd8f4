// The GPU committers (cuda_commit.h).

#include "cuda_commit.h"

#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>

#include "buffer_pool.h"

namespace hostcallback {

namespace {

// A GPU tap lost because its queue closed between its launch and its copy.
std::atomic<bool> g_said_lost_after_close{false};
constexpr char kLostAfterClose[] =
    "hostcallback: a GPU tap reached its device's queue after the queue closed, and was not "
    "delivered (a stop or exit waits for the taps dispatched before it; this one came as it "
    "closed)";

// A committer that ran out of memory while it took an entry: the record may be lost.
std::atomic<bool> g_said_committer_failed{false};
constexpr char kCommitterFailed[] =
    "hostcallback: out of host memory in a GPU device's committer: a GPU tap's record may be lost";

// The committer's events: no timing, and a wait for one sleeps instead of spinning a core.
constexpr unsigned kEventFlags = cuda::kEventDisableTiming | cuda::kEventBlockingSync;

}  // namespace

void SayOnce(std::atomic<bool>& said, const char* message) noexcept {
  if (said.exchange(true)) return;
  std::fprintf(stderr, "%s\n", message);
  std::fflush(stderr);
}

CudaCommitter::CudaCommitter(const cuda::Driver& driver) : driver_(driver) {
  std::thread([this] { Run(); }).detach();
}

cuda::Result CudaCommitter::TakeEvent(cuda::Event* event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_events_.empty()) {
      *event = free_events_.back();
      free_events_.pop_back();
      return cuda::Result{};
    }
  }
  return driver_.event_create(event, kEventFlags);
}

void CudaCommitter::Append(std::list<Entry>& entry) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    entries_.splice(entries_.end(), entry);
  }
  queued_cv_.notify_one();
}

cuda::Result CudaCommitter::RecordAndHand(cuda::Stream stream, const PendingRecord& pending) {
  std::list<Entry> entry{Entry{pending}};  // allocated before anything reaches the stream
  std::lock_guard<std::mutex> launching(launch_mu_);
  const cuda::Result recorded = driver_.event_record(pending.event, stream);
  if (static_cast<int>(recorded) != 0) {
    std::lock_guard<std::mutex> lock(mu_);
    free_events_.push_back(pending.event);
    return recorded;
  }
  Append(entry);
  return cuda::Result{};
}

cuda::Result CudaCommitter::QueueFence(cuda::Stream stream, DeviceQueue* queue) {
  std::list<Entry> entry(1);  // allocated before the wait is queued
  entry.front().pending.queue = queue;
  entry.front().is_fence = true;
  std::lock_guard<std::mutex> launching(launch_mu_);
  if (fence_word_ == nullptr) {
    void* word = nullptr;
    cuda::Result made = driver_.mem_host_alloc(
        &word, sizeof(uint32_t), cuda::kHostAllocPortable | cuda::kHostAllocDeviceMap);
    if (static_cast<int>(made) != 0) return made;
    made = driver_.mem_host_get_device_pointer(&fence_word_on_device_, word, 0);
    if (static_cast<int>(made) != 0) {
      driver_.mem_free_host(word);
      return made;
    }
    __atomic_store_n(static_cast<uint32_t*>(word), 0u, __ATOMIC_RELEASE);
    fence_word_ = static_cast<uint32_t*>(word);
  }
  // Once the wait is queued, only the committer's turn at its entry lets the stream go on: the
  // entry is appended whatever happens next. Values wrap; the wait compares them cyclically.
  const uint32_t value = last_fence_ + 1;
  const cuda::Result queued =
      driver_.stream_wait_value32(stream, fence_word_on_device_, value, cuda::kStreamWaitValueGeq);
  if (static_cast<int>(queued) != 0) return queued;
  last_fence_ = value;
  entry.front().fence_value = value;
  Append(entry);
  return cuda::Result{};
}

void CudaCommitter::Run() {
  cuda::Context current = nullptr;
  for (;;) {
    Entry entry;
    {
      std::unique_lock<std::mutex> lock(mu_);
      queued_cv_.wait(lock, [&] { return !entries_.empty(); });
      entry = entries_.front();
      entries_.pop_front();
    }
    try {
      Take(entry, &current);
    } catch (...) {  // out of memory for a message or a queue's ring
      SayOnce(g_said_committer_failed, kCommitterFailed);
    }
  }
}

void CudaCommitter::Take(const Entry& entry, cuda::Context* current) {
  if (entry.is_fence) {
    // Every record before the fence has joined its queue: once the receiver has handled them
    // (or is stuck), the stream goes on. The word is written whatever AwaitTaps found.
    try {
      entry.pending.queue->AwaitTaps(kTapPatienceSeconds);
    } catch (...) {
      SayOnce(g_said_committer_failed, kCommitterFailed);
    }
    __atomic_store_n(fence_word_, entry.fence_value, __ATOMIC_RELEASE);
    return;
  }
  const PendingRecord& pending = entry.pending;
  // The event's context, current on this thread for as long as its records come.
  if (pending.context != *current &&
      static_cast<int>(driver_.ctx_set_current(pending.context)) == 0) {
    *current = pending.context;
  }
  const cuda::Result waited = driver_.event_synchronize(pending.event);
  Finish(pending, waited);
  if (static_cast<int>(waited) == 0) {
    std::lock_guard<std::mutex> lock(mu_);
    try {
      free_events_.push_back(pending.event);
    } catch (...) {  // no memory for its place: the event is dropped
    }
  }
}

void CudaCommitter::Finish(const PendingRecord& pending, cuda::Result waited) {
  DeviceQueue* queue = pending.queue;
  if (static_cast<int>(waited) != 0) {
    // The stream failed before the copies were known done: the bytes may never have come, and
    // a copy may still write into the buffer, which is therefore never reused. The queue fails
    // with the driver's words, which the next barrier raises.
    queue->CancelReservation(pending.reserved);
    queue->Fail(cuda::Describe(driver_, "waiting for a GPU tap's copies", waited));
    return;
  }
  if (pending.failed) {
    ReleaseRecord(pending.record);
    queue->CancelReservation(pending.reserved);
    return;
  }
  int64_t joined = DeviceQueue::kClosed;
  bool no_memory = false;
  try {
    joined = queue->Commit(pending.record, pending.reserved);
  } catch (...) {  // no memory for the queue's ring: fail the queue, loudly, not the record
    static const std::string kNoMemory =
        "hostcallback: out of host memory for a GPU tap's place in its queue";
    queue->Fail(kNoMemory);
    no_memory = true;  // the queue's failure says so at the next barrier
  }
  if (joined < 0) {
    ReleaseRecord(pending.record);
    if (!no_memory && !IsBarrierMarker(pending.record) && !DropAtExit() &&
        !g_said_lost_after_close.load()) {
      try {  // why it closed: a stop, an exit, a Ctrl-C or the queue's failure
        std::string why = queue->ClosedReason();
        if (why.rfind("hostcallback: ", 0) == 0) why.erase(0, 14);
        SayOnce(g_said_lost_after_close, (std::string(kLostAfterClose) + ": " + why).c_str());
      } catch (...) {  // no memory for the words: say it without them
        SayOnce(g_said_lost_after_close, kLostAfterClose);
      }
    }
  }
}

CudaCommitter& CommitterFor(const cuda::Driver& driver, int device) {
  static std::mutex& mu = *new std::mutex();
  static auto& committers = *new std::unordered_map<int, CudaCommitter*>();
  std::lock_guard<std::mutex> lock(mu);
  CudaCommitter*& committer = committers[device];
  if (committer == nullptr) committer = new CudaCommitter(driver);
  return *committer;
}

}  // namespace hostcallback
