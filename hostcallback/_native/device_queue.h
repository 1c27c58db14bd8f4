// The device queues: one FIFO of records per (platform, device) under a byte budget, the table
// that finds them, and the way a record joins one (Enqueue).
#ifndef HOSTCALLBACK_NATIVE_DEVICE_QUEUE_H_
#define HOSTCALLBACK_NATIVE_DEVICE_QUEUE_H_

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "computations.h"
#include "record.h"

namespace hostcallback {

struct QueueStats {
  uint64_t records_enqueued = 0, bytes_enqueued = 0;  // taps and calls; barrier markers apart
  uint64_t records_delivered = 0, bytes_delivered = 0;
  uint64_t markers_enqueued = 0, markers_delivered = 0;
  // peak_bytes_queued: the most bytes held against the budget at once, room reserved included.
  uint64_t bytes_queued = 0, peak_bytes_queued = 0;
  uint64_t bytes_reserved = 0;  // room held for GPU taps whose copies are under way
  uint64_t waits = 0, wait_ns = 0;
  uint64_t producers_waiting = 0;
  uint64_t batches = 0;           // non-empty drains: records_delivered / batches is the mean batch
  uint64_t receiver_wakeups = 0;  // times a producer woke the receiver (a syscall on its thread)
  uint64_t receivers_waiting = 0;  // drains waiting on the queue now, GIL released
  uint64_t fences_waiting = 0;     // computations waiting at their end for their taps to be handled
  uint64_t fence_waits = 0, fence_wait_ns = 0;  // such waits (a fence that found its taps
                                                // handled already does not wait), and how long
  uint64_t fences_released = 0;  // waits that AwaitTaps ended on a receiver stuck in a batch
};

// The records of one queue, oldest first, in a circular buffer that grows by doubling: a
// stream of taps allocates nothing per record (a std::deque takes a block from malloc every 16
// records, for the receiver's thread to free). Once empty, a ring that a backlog grew
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
  std::vector<Record> TakeSpare();

 private:
  void Grow();

  std::vector<Record> slots_;  // empty, or a power of two of them
  size_t head_ = 0, count_ = 0;
};

// One device's outfeed: a FIFO of records under a byte budget. Producers (device threads)
// wait while the budget is spent and are admitted in arrival order, so a record larger than
// the whole budget, which waits for an empty queue and then goes in alone, is not overtaken by
// steady small traffic. Nothing is ever refused for its size or dropped.
// How long a computation waiting for its taps lets the receiver stay in one batch (AwaitTaps).
inline constexpr double kTapPatienceSeconds = 5.0;

class DeviceQueue {
 public:
  // kDroppedAtExit: a tap that found the queues closed by interpreter exit (SetExiting).
  // kInterrupted: the main thread waited for room and a signal handler raised (interrupts.h).
  // kForked: this process is a fork() of the one whose receivers drain the queues.
  // kWatchFailed: the watch a Reserve was given said its device failed.
  static constexpr int64_t kClosed = -1, kTimedOut = -2, kDroppedAtExit = -3, kInterrupted = -4,
                           kForked = -5, kWatchFailed = -6;

  // What WaitHandled found.
  // kInterrupted: a signal handler raised while the main thread waited (interrupts.h).
  // kForked: as for Push.
  enum class Handled {
    kYes,
    kStopped,
    kFailed,
    kTimedOut,
    kOwnReceiver,
    kReleased,
    kInterrupted,
    kForked
  };

  explicit DeviceQueue(int device_id) : device(device_id) {}

  const int device;                  // the id it is keyed by (with its platform)
  RunningComputations computations;  // the tapped computations running on this device now

  // Returns the record's sequence number, kClosed when the queue was closed (receiver stopped)
  // or kTimedOut when there was no room within timeout_s (a `call`'s timeout; taps wait
  // forever). A `call` record registers for its answer before any receiver can see it.
  // `urgent` (a call or a barrier marker) wakes a coalescing receiver at once. On kClosed,
  // kTimedOut or an exception the record stays the caller's.
  int64_t Push(Record record, bool expects_response, bool urgent, double timeout_s = 0);

  // A record whose bytes arrive later (a GPU tap, cuda_tap.cc) joins in two steps. Reserve waits
  // (in line, as Push does, and forever) for room for `bytes` in the budget and holds it:
  // 0, or kClosed or kInterrupted. While it waits it calls `watch` (if given) every
  // kWatchSeconds, without the lock: a non-empty answer (the device failed, so the records that
  // would make room will never come) ends the wait with kWatchFailed. Commit joins the record
  // under a reservation of `reserved` bytes without waiting, at the end of the queue as it is
  // then; kClosed (the record stays the caller's) when the queue was closed meanwhile.
  // CancelReservation gives room back unused.
  static constexpr double kWatchSeconds = 1.0;
  int64_t Reserve(uint64_t bytes, const std::function<bool()>& watch = nullptr);
  int64_t Commit(Record record, uint64_t reserved);
  void CancelReservation(uint64_t bytes) noexcept;

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
                          double coalesce_s = 0, double linger_s = 0);

  // Barrier markers a drain took from this queue and could not hand to Python (its decoding
  // failed: out of memory): kept here for the next drain, so that the barrier waiting for them
  // ends (with the error) instead of waiting forever.
  void KeepMarkers(const std::vector<uint64_t>& markers);
  std::vector<uint64_t> TakeKeptMarkers();

  // Waits until the receiver has handled every tap that joined before this call (its
  // consumers returned), up to timeout_s (0: forever). Records are handled in queue order, and
  // everything a Pop handed out has been handled once the receiver asks for more, so this waits
  // for the receiver's next Pop after them. It makes a gathering receiver hand out at once. A
  // stopped queue (kStopped) or a failed one (kFailed: ClosedReason says why) waits no longer.
  // kOwnReceiver: called on this queue's receiver thread while it delivers a batch, where a
  // wait would wait for itself (a computation run inline from a consumer); it does not wait.
  Handled WaitHandled(double timeout_s) { return WaitHandled(TapsEnqueued(), timeout_s); }
  // The same for the records below target (a value of TapsEnqueued()); with spin, it spins a
  // little (yielding) before it sleeps, as a fence does on its first wait.
  Handled WaitHandled(uint64_t target, double timeout_s, bool spin = false);
  // The target that covers every tap that joined so far and every record before it. A call
  // after the last tap is left out: its device has had its answer or given up on it, and a call
  // function that outlives its call must not keep its computation from ending.
  uint64_t TapsEnqueued();
  // The tapped computation (RunningComputations::CurrentOnThisThread when it joined) of the
  // record with this sequence number, if it is among the last kOrigins to join; else
  // kNoComputation.
  uint64_t ComputationOf(uint64_t sequence);
  // The batch the receiver is delivering now (a count of batches handed out), 0 between them;
  // with seconds, how long it has been delivering it.
  uint64_t DeliveringBatch(double* seconds = nullptr);

  // WaitHandled for every tap enqueued so far, forever unless the receiver is stuck: once it
  // has been delivering one batch for patience_s, the wait ends (kReleased, counted as
  // fences_released, said once on stderr), since a consumer may be waiting for this very
  // computation (its results, or those of a computation after it), which would otherwise wait
  // for the consumer forever. Not on the receiver's own thread (kOwnReceiver).
  Handled AwaitTaps(double patience_s);

  void SetClosed(bool closed);

  // Closes this queue for good: producers, waiting or future, fail with the reason.
  void Fail(const std::string& reason);

  // Why this queue refuses records: its failure, or that the receivers were stopped.
  std::string ClosedReason();

  // Wakes producers waiting for room, so that a larger budget takes effect at once. The budget
  // is stored outside mu_: taking mu_ first means a producer that read the old one is already
  // waiting, and is woken.
  void Poke() {
    { std::lock_guard<std::mutex> lock(mu_); }
    not_full_.notify_all();
  }

  // Calls waiting for room, and those to come, stop waiting (kInterrupted): the program exits
  // after a Ctrl-C and every call fails at once (Responses::InterruptCalls). Taps still wait.
  void InterruptCalls() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      calls_interrupted_ = true;
    }
    not_full_.notify_all();
  }

  QueueStats Stats();

  void ResetPeak();

 private:
  // A batch worth waking the receiver for (called under mu_).
  bool BatchReady() const;

  // Waits up to seconds for a batch worth waking for (BatchReady), while producers that find
  // this receiver gathering leave it asleep for anything less (called under mu_).
  void GatherFor(std::unique_lock<std::mutex>& lock, double seconds);

  // Tickets are admitted in order: the next one in line is admitted_ (called under mu_).
  void Admit(uint64_t ticket);

  // A ticket that leaves the line: admitted at once if it is next, skipped when its turn comes.
  void GiveUp(uint64_t ticket);

  bool Fits(size_t size) const;

  // Waits for the ticket's turn and room for `bytes` (or a closed queue): 0, or kTimedOut,
  // kInterrupted or kWatchFailed (see Reserve) with the ticket given up and the lock released
  // (called under mu_). A call (is_call) also stops waiting, kInterrupted, once calls are
  // interrupted (InterruptCalls).
  int64_t WaitForRoom(std::unique_lock<std::mutex>& lock, uint64_t ticket, uint64_t bytes,
                      double timeout_s, const std::function<bool()>& watch = nullptr,
                      bool is_call = false);

  // Puts an admitted record at the end of the queue, numbers it, calls on_joined (under mu_)
  // and wakes the receiver as needed; releases the lock. Throws bad_alloc with nothing joined.
  template <typename OnJoined>
  int64_t Join(std::unique_lock<std::mutex>& lock, Record& record, bool expects_response,
               bool urgent, OnJoined on_joined);

  // kYes, kOwnReceiver, or kTimedOut when WaitHandled would have to wait (called under mu_).
  Handled HandledAlready(uint64_t target) const;

  std::mutex mu_;
  std::condition_variable not_empty_, not_full_;
  RecordRing records_;
  uint64_t next_sequence_ = 0;
  struct Origin {
    uint64_t sequence = kNoComputation;  // no record yet
    uint64_t computation = kNoComputation;
  };
  static constexpr size_t kOrigins = 4096;  // records a failure can still be traced back to
  std::array<Origin, kOrigins> origins_{};
  // Records below handed_out_ left through Pop; those below handled_ have been handled; the
  // last tap (not a call, not a barrier marker) that joined is below taps_below_.
  uint64_t handed_out_ = 0, handled_ = 0, taps_below_ = 0;
  size_t fences_waiting_ = 0;
  std::atomic<uint64_t> handled_published_{0};  // handled_, for a fence that spins unlocked
  std::atomic<uint64_t> stuck_batch_{0};        // the last batch AwaitTaps found stuck
  uint64_t batches_handed_out_ = 0;
  bool delivering_ = false;
  std::chrono::steady_clock::time_point batch_began_{};
  std::condition_variable handled_cv_;
  uint64_t next_ticket_ = 0, admitted_ = 0;
  std::set<uint64_t> given_up_;  // tickets behind admitted_ whose producer stopped waiting
  bool closed_ = false;
  bool calls_interrupted_ = false;  // InterruptCalls
  // Drains waiting (for a first record, or gathering a batch: coalescing_ of them).
  size_t receivers_waiting_ = 0, coalescing_ = 0;
  size_t urgent_queued_ = 0, batch_records_ = 1, batch_bytes_ = 1;
  // The last Pop handed out records that were there or came within its linger_s: more are
  // likely to come as soon.
  bool streaming_ = false;
  // The last coalescing wait gathered more records, or a Pop found several queued since.
  bool coalescing_pays_ = true;
  std::string failure_;
  std::vector<uint64_t> kept_markers_;
  QueueStats stats_;
};

// ---- the queue table --------------------------------------------------------------------------

// The queue of (platform, device), made on first use and never freed: device threads may hold
// it. A queue made while the queues are closed starts closed.
DeviceQueue* LookUpQueue(const std::string& platform, int device);

// The native handlers' queue of a device of kNativePlatform, found without a lock.
DeviceQueue* NativeQueueFor(int device);
// The same for a GPU device (kGpuPlatform) by its global id: the GPU tap handler's queues.
DeviceQueue* GpuQueueFor(int device);

// Closed queues refuse new records and wake every waiter; calls still waiting for an answer fail.
void SetAllClosed(bool closed);

// A new byte budget for every queue, taking effect at once for producers waiting for room.
void SetQueueBudget(uint64_t max_queue_bytes);

// DeviceQueue::InterruptCalls on every queue.
void InterruptCallsWaitingForRoom();

// Interpreter exit has given up waiting: a tap that finds its queue closed from now on is
// dropped and counted (DroppedAtExit) instead of failing its computation, whose error JAX's own
// exit handlers would print; exit's warning has said how much was left.
void SetExiting();
uint64_t DroppedAtExit();
// Exit was told to leave at once (a second Ctrl-C): a tap that finds its queue closed from then
// on fails its computation, so that XLA stops running it; dropped, the taps would let it run to
// its end, and finalization waits for it (minutes, for a long loop of taps).
void SetLeaving();
// Why a closed queue refuses a tap or call, where no failure of its own says more: a Ctrl-C that
// left, interpreter exit, or stop_outfeed_receiver().
std::string StoppedReason();
// A tap that found its queue closed: once exit has given up waiting (SetExiting), it is counted
// as dropped at exit (true); before that it is an error (false).
bool DropAtExit();

// A child of fork() has the queues of its parent but not the receiver threads that drain them
// (nor, maybe, the locks another thread held at the fork): there, every enqueue and every wait
// for taps to be handled fails at once with kForkedMessage, taking no lock. Set by the
// pthread_atfork handler that module.cc registers.
void NoteForkedChild();
bool InForkedChild();
inline constexpr char kForkedMessage[] =
    "hostcallback: this process is a fork() of the one whose receivers deliver taps and calls, "
    "and has none of its own: taps and calls cannot be delivered here (start worker processes "
    "with multiprocessing's \"spawn\" or \"forkserver\" method, or tap in the parent only)";

// ---- joining a queue --------------------------------------------------------------------------

// The record's sequence number, or DeviceQueue::kClosed, kTimedOut (WhyNotEnqueued says why: no
// message is built for a tap that went in) or kDroppedAtExit (a tap: not an error). timeout_s
// bounds the wait for room (a `call`'s timeout; 0: forever). Throws bad_alloc when the record
// cannot be allocated; the record never leaks. held_bytes, run_id: see Record.
int64_t Enqueue(DeviceQueue* queue, int device, uint64_t consumer_id, ArrayViews arrays,
                uint16_t flags = 0, double timeout_s = 0, xla::ffi::ThreadPool* pool = nullptr,
                uint64_t held_bytes = 0, int64_t run_id = kUnknownRun);

std::string WhyNotEnqueued(DeviceQueue* queue, int64_t pushed, double timeout_s);

// Why a computation's taps were not all handled, by what AwaitTaps found: the queue's failure, a
// fork, an interruption; the empty string where that is no error (handled, stopped, released).
std::string WhyTapsNotHandled(DeviceQueue* queue, DeviceQueue::Handled handled);

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_DEVICE_QUEUE_H_
