// Keeps the device queues: admission under the byte budget, batching for the receiver, the
// table of queues by (platform, device), and Enqueue. Runs on device threads and on receivers
// with the GIL released; no Python.

#include "device_queue.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <utility>

#include "buffer_pool.h"
#include "constants.h"
#include "interrupts.h"
#include "responses.h"
#include "spin_wait.h"
#include "timeouts.h"

namespace hostcallback {

namespace {
// How long a fence spins for its taps to be handled before it sleeps (WaitHandled).
constexpr std::chrono::microseconds kFenceSpin{200};
// The queue whose batch this thread is delivering (a receiver between two Pops), if any.
thread_local const DeviceQueue* t_delivering = nullptr;
}  // namespace

// ---- the ring ---------------------------------------------------------------------------------

std::vector<Record> RecordRing::TakeSpare() {
  std::vector<Record> spare;
  if (count_ == 0 && slots_.size() > kKeptSlots) {
    spare.swap(slots_);
    head_ = 0;
  }
  return spare;
}

void RecordRing::Grow() {
  std::vector<Record> bigger(std::max<size_t>(64, slots_.size() * 2));
  for (size_t i = 0; i < count_; ++i) bigger[i] = slots_[(head_ + i) & (slots_.size() - 1)];
  slots_.swap(bigger);
  head_ = 0;
}

// ---- one queue --------------------------------------------------------------------------------

template <typename OnJoined>
int64_t DeviceQueue::Join(std::unique_lock<std::mutex>& lock, Record& record, bool expects_response,
                          bool urgent, OnJoined on_joined) {
  const uint64_t sequence = next_sequence_;
  try {
    if (expects_response) g_responses.Expect({this, sequence});
    Put<uint64_t>(record.data + kSequenceOffset, sequence);
    record.urgent = urgent;
    records_.push_back(record);
  } catch (...) {
    if (expects_response) g_responses.Forget({this, sequence});
    throw;
  }
  // The computation that made the record: its execution's, else, where the execution cannot
  // tell (a record from Python), the one this thread began.
  bool unsure = true;
  uint64_t computation = computations.OfRun(record.run_id, &unsure);
  if (unsure) computation = computations.CurrentOnThisThread();
  origins_[sequence % kOrigins] = Origin{sequence, computation};
  next_sequence_ += 1;
  if (!expects_response && !IsBarrierMarker(record)) taps_below_ = next_sequence_;
  on_joined();
  (IsBarrierMarker(record) ? stats_.markers_enqueued : stats_.records_enqueued) += 1;
  stats_.bytes_enqueued += BudgetBytes(record);
  stats_.bytes_queued += BudgetBytes(record);
  stats_.peak_bytes_queued =
      std::max(stats_.peak_bytes_queued, stats_.bytes_queued + stats_.bytes_reserved);
  if (urgent) urgent_queued_ += 1;
  // Wake the receiver only when it sleeps and, while it gathers a batch, only when the batch
  // is ready: under load a receiver wakes once per batch, not once per record.
  const bool wake = receivers_waiting_ > coalescing_ || (receivers_waiting_ > 0 && BatchReady());
  const bool others_wait = stats_.producers_waiting > 0;
  if (wake) stats_.receiver_wakeups += 1;
  lock.unlock();
  if (wake) not_empty_.notify_all();        // one receiver per queue: all is one
  if (others_wait) not_full_.notify_all();  // the next in line may fit now
  return static_cast<int64_t>(sequence);
}

int64_t DeviceQueue::WaitForRoom(std::unique_lock<std::mutex>& lock, uint64_t ticket,
                                 uint64_t bytes, double timeout_s,
                                 const std::function<bool()>& watch, bool is_call) {
  auto refused = [&] { return is_call && calls_interrupted_; };
  auto admitted = [&] { return closed_ || refused() || (ticket <= admitted_ && Fits(bytes)); };
  if (admitted() && !refused()) return 0;
  auto start = std::chrono::steady_clock::now();
  stats_.producers_waiting += 1;
  // A receiver that is gathering a batch must not keep a full queue waiting.
  if (receivers_waiting_ > 0) not_empty_.notify_all();
  std::string interrupted;
  bool in = false, watch_failed = false;
  if (!watch) {
    in = WaitInterruptibly(not_full_, lock, timeout_s, admitted, &interrupted);
  } else {  // (a watched wait waits forever: Reserve's)
    while (!(in = WaitInterruptibly(not_full_, lock, kWatchSeconds, admitted, &interrupted)) &&
           interrupted.empty()) {
      lock.unlock();
      watch_failed = watch();
      lock.lock();
      if (watch_failed) break;
    }
    in = in || admitted();
  }
  const bool interrupted_call = refused() && !closed_;
  if (interrupted_call) in = false;
  stats_.producers_waiting -= 1;
  stats_.waits += 1;
  stats_.wait_ns +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count();
  if (!in) {
    GiveUp(ticket);
    lock.unlock();
    not_full_.notify_all();  // those behind this ticket may go in now
    if (watch_failed) return kWatchFailed;
    return interrupted.empty() && !interrupted_call ? kTimedOut : kInterrupted;
  }
  // Admitted as the handler raised: the record goes in, and the next wait of this thread
  // looks at the signal again at once (Python's KeyboardInterrupt is pending again).
  if (!interrupted.empty()) NoteInterrupt();
  return 0;
}

int64_t DeviceQueue::Push(Record record, bool expects_response, bool urgent, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t ticket = next_ticket_++;
  if (int64_t waited =
          WaitForRoom(lock, ticket, BudgetBytes(record), timeout_s, nullptr, expects_response);
      waited < 0) {
    return waited;
  }
  if (closed_) return kClosed;
  try {
    return Join(lock, record, expects_response, urgent, [&] { Admit(ticket); });
  } catch (...) {  // out of memory: nothing joined, and the line behind this ticket moves on
    GiveUp(ticket);
    lock.unlock();
    not_full_.notify_all();
    throw;
  }
}

int64_t DeviceQueue::Reserve(uint64_t bytes, const std::function<bool()>& watch) {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t ticket = next_ticket_++;
  if (int64_t waited = WaitForRoom(lock, ticket, bytes, 0, watch); waited < 0) return waited;
  if (closed_) return kClosed;
  stats_.bytes_reserved += bytes;
  stats_.peak_bytes_queued =
      std::max(stats_.peak_bytes_queued, stats_.bytes_queued + stats_.bytes_reserved);
  Admit(ticket);
  const bool others_wait = stats_.producers_waiting > 0;
  lock.unlock();
  if (others_wait) not_full_.notify_all();  // the next in line may fit too
  return 0;
}

void DeviceQueue::CancelReservation(uint64_t bytes) noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_reserved -= bytes;
  }
  not_full_.notify_all();
}

int64_t DeviceQueue::Commit(Record record, uint64_t reserved) {
  std::unique_lock<std::mutex> lock(mu_);
  stats_.bytes_reserved -= reserved;
  if (closed_) {
    lock.unlock();
    not_full_.notify_all();
    return kClosed;
  }
  try {
    return Join(lock, record, false, IsBarrierMarker(record), [] {});
  } catch (...) {  // out of memory: the reservation is given back, the record stays the caller's
    lock.unlock();
    not_full_.notify_all();
    throw;
  }
}

std::vector<Record> DeviceQueue::Pop(size_t max_records, size_t max_bytes, double timeout_s,
                                     double coalesce_s, double linger_s) {
  std::vector<Record> out;
  std::unique_lock<std::mutex> lock(mu_);
  t_delivering = nullptr;
  delivering_ = false;
  // The receiver asks for more: what it was handed before has been handled.
  if (handled_ != handed_out_) {
    handled_ = handed_out_;
    handled_published_.store(handled_, std::memory_order_release);
    if (fences_waiting_ > 0) handled_cv_.notify_all();
  }
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
    bytes += BudgetBytes(records_.front());
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
  handed_out_ = next_sequence_ - records_.size();
  if (!out.empty()) {
    t_delivering = this;
    delivering_ = true;
    batches_handed_out_ += 1;
    batch_began_ = std::chrono::steady_clock::now();
  }
  std::vector<Record> spare = records_.TakeSpare();  // freed after the unlock
  lock.unlock();
  if (!out.empty()) not_full_.notify_all();
  return out;
}

uint64_t DeviceQueue::ComputationOf(uint64_t sequence) {
  std::lock_guard<std::mutex> lock(mu_);
  const Origin& origin = origins_[sequence % kOrigins];
  return origin.sequence == sequence ? origin.computation : kNoComputation;
}

uint64_t DeviceQueue::TapsEnqueued() {
  std::lock_guard<std::mutex> lock(mu_);
  return taps_below_;
}

namespace {
void SayReleasedOnce(double patience_s) {
  static std::atomic<bool> said{false};
  if (said.exchange(true)) return;
  std::fprintf(stderr,
               "hostcallback: a device's receiver has been running one consumer for %g "
               "s: a computation waiting for its taps to be handled goes on without them (they "
               "follow once the consumer returns), in case the consumer waits for that "
               "computation's results. queue_stats() counts such computations as "
               "fences_released. A consumer that runs JAX work should do it on a thread of its "
               "own, or the computations it waits for should be compiled with "
               "hostcallback.configure(delivery=\"async\").\n",
               patience_s);
  std::fflush(stderr);
}
}  // namespace

void DeviceQueue::KeepMarkers(const std::vector<uint64_t>& markers) {
  std::lock_guard<std::mutex> lock(mu_);
  kept_markers_.insert(kept_markers_.end(), markers.begin(), markers.end());
}

std::vector<uint64_t> DeviceQueue::TakeKeptMarkers() {
  std::vector<uint64_t> taken;
  std::lock_guard<std::mutex> lock(mu_);
  taken.swap(kept_markers_);
  return taken;
}

DeviceQueue::Handled DeviceQueue::AwaitTaps(double patience_s) {
  if (InForkedChild()) return Handled::kForked;
  const uint64_t target = TapsEnqueued();
  Handled handled;
  {
    std::lock_guard<std::mutex> lock(mu_);
    handled = HandledAlready(target);
  }
  if (handled != Handled::kTimedOut) return handled;  // caught up already: no wait counted
  const auto start = std::chrono::steady_clock::now();
  bool first = true;
  while (true) {
    // A batch found stuck already releases at once: every computation waiting behind it would
    // otherwise pay the patience again.
    double seconds_in_batch = 0;
    const uint64_t batch = DeliveringBatch(&seconds_in_batch);
    if (batch != 0 && (batch == stuck_batch_.load() || seconds_in_batch >= patience_s)) {
      stuck_batch_.store(batch);
      handled = Handled::kReleased;
      break;
    }
    handled = WaitHandled(target, patience_s / 10, /*spin=*/first);
    first = false;
    if (handled != Handled::kTimedOut) break;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.fence_waits += 1;
    stats_.fence_wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::steady_clock::now() - start)
                                .count();
    if (handled == Handled::kReleased) stats_.fences_released += 1;
  }
  if (handled == Handled::kReleased) SayReleasedOnce(patience_s);
  return handled;
}

uint64_t DeviceQueue::DeliveringBatch(double* seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!delivering_) return 0;
  if (seconds != nullptr) {
    *seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - batch_began_).count();
  }
  return batches_handed_out_;
}

DeviceQueue::Handled DeviceQueue::HandledAlready(uint64_t target) const {
  if (handled_ >= target) return Handled::kYes;
  return t_delivering == this ? Handled::kOwnReceiver : Handled::kTimedOut;
}

DeviceQueue::Handled DeviceQueue::WaitHandled(uint64_t target, double timeout_s, bool spin) {
  if (InForkedChild()) return Handled::kForked;
  std::unique_lock<std::mutex> lock(mu_);
  if (Handled now = HandledAlready(target); now != Handled::kTimedOut) return now;
  auto done = [&] { return handled_ >= target || closed_; };
  fences_waiting_ += 1;
  if (receivers_waiting_ > 0) not_empty_.notify_all();  // a gathering receiver: hand out now
  // The receiver usually comes back within tens of microseconds: a wait that sleeps would add a
  // wake-up of this thread on top, on the path of every step (spin_wait.h).
  if (spin) {
    lock.unlock();
    SpinYielding(SpinWithin(kFenceSpin, timeout_s),
                 [&] { return handled_published_.load(std::memory_order_acquire) >= target; });
    lock.lock();
  }
  std::string interrupted;
  WaitInterruptibly(handled_cv_, lock, timeout_s, done, &interrupted);
  fences_waiting_ -= 1;
  if (!interrupted.empty()) return Handled::kInterrupted;  // even if handled meanwhile
  if (handled_ >= target) return Handled::kYes;
  if (!failure_.empty()) return Handled::kFailed;
  return closed_ ? Handled::kStopped : Handled::kTimedOut;
}

void DeviceQueue::SetClosed(bool closed) {
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
  handled_cv_.notify_all();
}

void DeviceQueue::Fail(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = reason;
    closed_ = true;
  }
  not_full_.notify_all();
  not_empty_.notify_all();
  handled_cv_.notify_all();
}

std::string DeviceQueue::ClosedReason() {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_.empty() ? StoppedReason() : failure_;
}

QueueStats DeviceQueue::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  QueueStats now = stats_;
  now.receivers_waiting = receivers_waiting_;
  now.fences_waiting = fences_waiting_;
  return now;
}

void DeviceQueue::ResetPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_bytes_queued = stats_.bytes_queued + stats_.bytes_reserved;
}

bool DeviceQueue::BatchReady() const {
  return closed_ || urgent_queued_ > 0 || stats_.producers_waiting > 0 || fences_waiting_ > 0 ||
         records_.size() >= batch_records_ || stats_.bytes_queued >= batch_bytes_;
}

void DeviceQueue::GatherFor(std::unique_lock<std::mutex>& lock, double seconds) {
  if (BatchReady()) return;
  coalescing_ += 1;
  not_empty_.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return BatchReady(); });
  coalescing_ -= 1;
}

void DeviceQueue::Admit(uint64_t ticket) {
  admitted_ = std::max(admitted_, ticket + 1);
  while (given_up_.erase(admitted_) > 0) admitted_ += 1;
}

void DeviceQueue::GiveUp(uint64_t ticket) {
  if (ticket < admitted_) return;
  if (ticket == admitted_) {
    Admit(ticket);
  } else {
    given_up_.insert(ticket);
  }
}

bool DeviceQueue::Fits(size_t size) const {
  const uint64_t held = stats_.bytes_queued + stats_.bytes_reserved;
  return held == 0 || held + size <= g_max_queue_bytes.load(std::memory_order_relaxed);
}

// ---- the queue table --------------------------------------------------------------------------

namespace {

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

// The native handlers' lookup without a lock: queues live forever, so each is kept in a slot
// picked by its device id (a thread-local costs a call into the dynamic linker a tap). One
// process's ids (0 and up on the first, 2048 and up on the second on XLA's CPU client) fall in
// different slots; two that shared one would only take LookUpQueue's lock more often.
constexpr unsigned kNativeQueueSlots = 1024;
std::atomic<DeviceQueue*> g_native_queues[kNativeQueueSlots];

}  // namespace

DeviceQueue* LookUpQueue(const std::string& platform, int device) {
  std::lock_guard<std::mutex> lock(g_queues.mu);
  DeviceQueue*& q = g_queues.queues[{platform, device}];
  if (q == nullptr) {
    q = new DeviceQueue(device);
    if (g_queues.closed) q->SetClosed(true);
  }
  return q;
}

namespace {

// A slot's queue, or the queue of (platform, device) put in that slot.
DeviceQueue* CachedQueue(std::atomic<DeviceQueue*>& slot, const char* platform, int device) {
  DeviceQueue* q = slot.load(std::memory_order_acquire);
  if (q == nullptr || q->device != device) {
    q = LookUpQueue(platform, device);
    slot.store(q, std::memory_order_release);
  }
  return q;
}

std::atomic<DeviceQueue*> g_gpu_queues[kNativeQueueSlots];

}  // namespace

DeviceQueue* NativeQueueFor(int device) {
  return CachedQueue(g_native_queues[static_cast<unsigned>(device) % kNativeQueueSlots],
                     kNativePlatform, device);
}

DeviceQueue* GpuQueueFor(int device) {
  return CachedQueue(g_gpu_queues[static_cast<unsigned>(device) % kNativeQueueSlots], kGpuPlatform,
                     device);
}

void SetAllClosed(bool closed) {
  std::lock_guard<std::mutex> lock(g_queues.mu);
  g_queues.closed = closed;
  for (auto& [key, q] : g_queues.queues) q->SetClosed(closed);
  g_responses.SetClosed(closed);  // calls still waiting for an answer fail instead of hanging
}

namespace {
std::atomic<bool> g_exiting{false}, g_leaving{false};
std::atomic<uint64_t> g_dropped_at_exit{0};
}  // namespace

void SetExiting() { g_exiting.store(true); }

void SetLeaving() { g_leaving.store(true); }

namespace {
bool Leaving() { return g_leaving.load(std::memory_order_relaxed); }
}  // namespace

std::string StoppedReason() {
  if (Leaving()) {
    return "hostcallback: the program was interrupted (Ctrl-C) and left without its taps and "
           "calls";
  }
  if (g_exiting.load()) {
    return "hostcallback: the program is exiting, and its receivers have stopped: taps and calls "
           "cannot be delivered any more";
  }
  return Responses::kStoppedMessage;
}

namespace {
std::atomic<bool> g_forked_child{false};
}  // namespace

void NoteForkedChild() { g_forked_child.store(true); }

bool InForkedChild() { return g_forked_child.load(std::memory_order_relaxed); }

uint64_t DroppedAtExit() { return g_dropped_at_exit.load(); }

bool DropAtExit() {
  if (!g_exiting.load() || Leaving()) return false;
  g_dropped_at_exit.fetch_add(1);
  return true;
}

void SetQueueBudget(uint64_t max_queue_bytes) {
  g_max_queue_bytes.store(max_queue_bytes);
  std::lock_guard<std::mutex> lock(g_queues.mu);
  for (auto& [key, q] : g_queues.queues) q->Poke();
}

void InterruptCallsWaitingForRoom() {
  std::lock_guard<std::mutex> lock(g_queues.mu);
  for (auto& [key, q] : g_queues.queues) q->InterruptCalls();
}

// ---- joining a queue --------------------------------------------------------------------------

int64_t Enqueue(DeviceQueue* queue, int device, uint64_t consumer_id, ArrayViews arrays,
                uint16_t flags, double timeout_s, xla::ffi::ThreadPool* pool, uint64_t held_bytes,
                int64_t run_id) {
  if (InForkedChild()) return DeviceQueue::kForked;
  Record record = EncodeRecord(consumer_id, static_cast<uint32_t>(device), arrays, flags, pool);
  record.held_bytes = held_bytes;
  record.run_id = run_id;
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
  if (pushed == DeviceQueue::kClosed && !expects_response && consumer_id != kBarrierMarkerId &&
      DropAtExit()) {
    return DeviceQueue::kDroppedAtExit;
  }
  return pushed;
}

std::string WhyNotEnqueued(DeviceQueue* queue, int64_t pushed, double timeout_s) {
  if (pushed == DeviceQueue::kTimedOut) {
    return TimeoutMessage(timeout_s) + " (its device's queue stayed full)";
  }
  if (pushed == DeviceQueue::kForked) return kForkedMessage;
  if (pushed == DeviceQueue::kInterrupted) {
    return "hostcallback: " + LastInterruption() +
           " while it waited for room in its device's full outfeed queue";
  }
  return queue->ClosedReason();
}

std::string WhyTapsNotHandled(DeviceQueue* queue, DeviceQueue::Handled handled) {
  switch (handled) {
    case DeviceQueue::Handled::kFailed: return queue->ClosedReason();
    case DeviceQueue::Handled::kForked: return kForkedMessage;
    case DeviceQueue::Handled::kInterrupted:
      return "hostcallback: the computation was " + LastInterruption() +
             " while it waited for its taps to be handled";
    default: return "";
  }
}

}  // namespace hostcallback
