// A call shared over the devices of a sharded computation in this process, met in our handler
// rather than in XLA's collectives. XLA's CPU client sometimes leaves a device's part of a step
// unstarted while the others wait in a collective, and then ends the process after its
// rendezvous limit, before any timeout of ours can speak. Here each device's part of one
// execution (XLA's run id) brings its own shard of the operands. The calling device's part waits
// until every part has come, calls the host with all the shards, and leaves the outcome every
// part gets: the host's answer, or why there is none (an error, the call's timeout, a part that
// never came within kPartsPatienceSeconds, an interruption), whichever is decided first.
#ifndef HOSTCALLBACK_NATIVE_SHARED_CALLS_H_
#define HOSTCALLBACK_NATIVE_SHARED_CALLS_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "record.h"
#include "responses.h"
#include "spin_wait.h"

namespace hostcallback {

// How long the parts wait for each other before the host is called, where the call's own
// timeout is longer or absent: XLA's own rendezvous limit on CPU (40 s), after which XLA would
// have ended the process; here the computation fails saying so instead.
inline constexpr double kPartsPatienceSeconds = 40;

// Sends the call with every part's shard (in device order) and waits at most timeout_s for the
// answer: CallHost on the calling device's queue.
using HostCaller = std::function<std::string(ArrayViews arrays, double timeout_s, Response*)>;

// Copies the answer into one part's outputs; returns why it cannot.
using AnswerTaker = std::function<std::string(const Response&)>;

class SharedCalls {
 public:
  // One device's part joins the call at `site` (one id per call op of the program, the same in
  // every device's part) made by its execution run_id (its n-th one there, n counted per
  // device: a loop's iterations), with views of its shard, and waits for the outcome (the part
  // stays while the host call may read its shard). Returns "" once take_answer took the
  // answer, or why there is none. call_host runs on emit_device's part. Two calls of one
  // consumer at two sites never meet, whatever order XLA runs them in on each device.
  std::string Join(int64_t run_id, uint64_t site, int device, int emit_device, size_t parts,
                   double timeout_s, ArrayViews shard, const HostCaller& call_host,
                   const AnswerTaker& take_answer);

  // Calls kept now: waiting for some part or for the host, or decided and waiting for a part to
  // take the outcome (for tests: 0 once every call's parts all came and left).
  size_t Open();

 private:
  using Clock = std::chrono::steady_clock;
  using Key = std::tuple<int64_t, uint64_t, uint64_t>;  // run id, site, occurrence

  struct Call {
    size_t parts = 0;
    Clock::time_point started;                     // the first part's arrival
    std::map<int, std::vector<ArrayView>> shards;  // by device: views of its operands
    bool calling = false;                          // the host call reads the shards: no part leaves
    bool decided = false;
    std::string error;
    Response answer;
    size_t inside = 0;        // parts in Join now
    size_t taken = 0;         // parts that took the outcome
    bool forgotten = false;   // dropped from decided_ while parts were inside: the last erases it
    uint64_t generation = 0;  // tells it from an earlier call of the same key in decided_
  };

  using Part = std::tuple<int64_t, uint64_t, int>;  // run id, site, device

  uint64_t NextOccurrence(int64_t run_id, uint64_t site, int device);
  // Under mu_: the outcome is decided.
  void Decide(const Key& key, Call& call, std::string error, Response answer);

  std::mutex mu_;
  std::condition_variable cv_;
  Changes changes_;  // a part came, a call was decided or its host call ended
  std::map<Key, Call> calls_;
  // Decided calls, newest last: the oldest are dropped, so a call some part never came to
  // (XLA never started it) is not kept for good.
  std::deque<std::pair<Key, uint64_t>> decided_;  // with the call's generation
  uint64_t generations_ = 0;
  // Per part: how many calls it has made; the kPartsKept used last (least recently used last).
  std::list<Part> recent_parts_;
  std::map<Part, std::pair<uint64_t, std::list<Part>::iterator>> occurrences_;
  // Why a (run, site) call failed, for a part that comes after its call was dropped: it
  // fails at once rather than wait alone. The newest kFailuresKept.
  std::map<std::pair<int64_t, uint64_t>, std::string> failures_;
  std::deque<std::pair<int64_t, uint64_t>> failure_order_;
  static constexpr size_t kPartsKept = 4096;
  static constexpr size_t kDecidedKept = 256;
  static constexpr size_t kFailuresKept = 4096;
};

// Never destroyed (see the rules at the top of module.cc).
extern SharedCalls& g_shared_calls;

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_SHARED_CALLS_H_
