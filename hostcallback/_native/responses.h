// The answers to `call` records: where the receiver leaves the host's answer, and how a device
// sends a call and waits for it.
#ifndef HOSTCALLBACK_NATIVE_RESPONSES_H_
#define HOSTCALLBACK_NATIVE_RESPONSES_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "record.h"
#include "spin_wait.h"

namespace hostcallback {

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
  void Expect(Key key);

  // The call record never joined its queue after all: forget its entry.
  void Forget(Key key) noexcept;

  // Stores the answer and returns true if its call still waits; drops it and returns false
  // otherwise (timed out, stopped).
  bool Set(Key key, Response response);

  // Whether the call still waits for its answer (not timed out, stopped or answered).
  bool Waiting(Key key);

  // Why no answer came (stopped, timed out), or the empty string with *out set.
  // timeout_s is what is left of the call's timeout, the whole of which the message names.
  std::string Wait(Key key, double timeout_s, Response* out, double call_timeout_s);

  // (calls waiting for an answer, answers not yet taken by their call) for one queue.
  std::pair<uint64_t, uint64_t> Counts(const DeviceQueue* queue);

  void SetClosed(bool closed);

  // The program was ended by a Ctrl-C and exits: every waiting and future call fails at once with
  // kInterruptedMessage, so that computations of calls end (those on XLA's worker threads, which
  // never see Python's signals, too), while taps are still delivered.
  void InterruptCalls();
  bool CallsInterrupted() const;
  static constexpr char kInterruptedMessage[] =
      "hostcallback: the call was interrupted (Ctrl-C) as the program exits";

  // Every waiting and future call on this queue fails with the reason (its receiver died).
  void Fail(const DeviceQueue* queue, const std::string& reason);

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
  Changes changes_;  // an answer, a close, a failure: what a spinning Wait looks for
  std::map<Key, Entry> table_;
  std::map<const DeviceQueue*, std::string> failed_;
  bool closed_ = false;
  std::atomic<bool> calls_interrupted_{false};  // InterruptCalls (set under mu_)
};

// Why a shared call failed where its reason is not in this process (it failed on a device of
// another).
inline constexpr char kCallFailedElsewhere[] =
    "hostcallback: the call failed on a device of another process (its log says why)";

// Why a shared call failed: written by the calling device under a failure id of its own, which
// is the call's failure flag, read by every device of the computation once the flag has reached
// them all (summed: only the caller's is not 0): by HostcallbackCheck, or by the callback
// transport's check in Python (keep_call_failure, call_failure_reason). Keyed by (consumer,
// id), so that overlapping executions of one call, or a failure in another process, never read
// another failure's reason. The newest kKept are kept: every device reads a reason right after
// it was written.
class CallFailures {
 public:
  CallFailures();

  // The failure id (never 0, "no failure") the reason is kept under.
  uint32_t Keep(uint64_t consumer_id, const std::string& reason);
  // The reason, or kCallFailedElsewhere for an id not kept here.
  std::string Reason(uint64_t consumer_id, uint32_t id);

 private:
  static constexpr size_t kKept = 1024;
  std::mutex mu_;
  // A different start in each process: an id from another process is unlikely to be one here.
  uint32_t next_id_;
  std::map<std::pair<uint64_t, uint32_t>, std::string> reasons_;
  std::deque<std::pair<uint64_t, uint32_t>> order_;
};

// Never destroyed (see the rules at the top of module.cc).
extern CallFailures& g_call_failures;

// Never destroyed (see the rules at the top of module.cc).
extern Responses& g_responses;

// Sends a call record and waits for the answer; fills *response or says why it could not.
// flags: the record's (kFlagExpectsResponse and more); pool: XLA's threads, which copy large
// arrays (null: from Python, see EncodeRecord).
std::string CallHost(DeviceQueue* queue, int device, uint64_t consumer_id, ArrayViews arrays,
                     double timeout_s, Response* response, uint16_t flags = kFlagExpectsResponse,
                     xla::ffi::ThreadPool* pool = nullptr);

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_RESPONSES_H_
