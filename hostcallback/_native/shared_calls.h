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
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "record.h"
#include "responses.h"

namespace hostcallback {

// How long the parts wait for each other before the host is called, where the call's own
// timeout is longer or absent: XLA's own rendezvous limit on CPU (40 s), after which XLA would
// have ended the process; here the computation fails saying so instead.
inline constexpr double kPartsPatienceSeconds = 40;

// Sends the call with every part's shard (in device order) and waits at most timeout_s for the
// answer: CallHost on the calling device's queue.
using HostCaller = std::function<std::string(ArrayViews arrays, double timeout_s, Response*)>;

// Copies the answer into one part's outputs (under the table's lock); returns why it cannot.
using AnswerTaker = std::function<std::string(const Response&)>;

class SharedCalls {
 public:
  // One device's part joins the call of consumer_id made by its execution run_id (its n-th one
  // there, n counted per device), with its shard, and waits for the outcome. Returns "" once
  // take_answer took the answer, or why there is none. call_host runs on emit_device's part.
  std::string Join(int64_t run_id, uint64_t consumer_id, int device, int emit_device, size_t parts,
                   double timeout_s, ArrayViews shard, const HostCaller& call_host,
                   const AnswerTaker& take_answer);

  // Calls still waiting for some part or for the host (for tests: 0 when all have ended).
  size_t Open();

 private:
  using Clock = std::chrono::steady_clock;
  using Key = std::tuple<int64_t, uint64_t, uint64_t>;  // run id, consumer id, occurrence

  struct OwnedArray {
    uint8_t dtype;
    std::vector<int64_t> dims;
    std::vector<uint8_t> bytes;
  };
  struct Call {
    size_t parts = 0;
    Clock::time_point started;                      // the first part's arrival
    std::map<int, std::vector<OwnedArray>> shards;  // by device
    bool calling = false;                           // the host call reads the shards
    bool decided = false;
    std::string error;
    Response answer;
    size_t inside = 0;       // parts in Join now
    size_t taken = 0;        // parts that took the outcome
    bool forgotten = false;  // dropped from decided_ while parts were inside: the last erases it
  };

  uint64_t NextOccurrence(int64_t run_id, uint64_t consumer_id, int device);
  // Under mu_: the outcome is decided.
  void Decide(const Key& key, Call& call, std::string error, Response answer);

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Key, Call> calls_;
  // Decided calls, newest last: the oldest are dropped, so a call some part never came to
  // (XLA never started it) is not kept for good.
  std::deque<Key> decided_;
  // Per (run, consumer, device): how many calls that part has made; the newest kRunsKept.
  std::map<std::tuple<int64_t, uint64_t, int>, uint64_t> occurrences_;
  std::deque<std::tuple<int64_t, uint64_t, int>> occurrence_order_;
  static constexpr size_t kRunsKept = 4096;
  static constexpr size_t kDecidedKept = 256;
};

// Never destroyed (see the rules at the top of module.cc).
extern SharedCalls& g_shared_calls;

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_SHARED_CALLS_H_
