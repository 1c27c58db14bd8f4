// The tapped computations running on one device. Each begins (hostcallback_begin) before its
// first tap and ends once its fence has seen its taps handled (hostcallback_fence), or when one
// of our handlers fails it (XLA then skips the rest, fence included: EndFailedOnThisThread).
// XLA's CPU client orders single-device computations only per dispatching thread, so a barrier
// sent from one thread cannot queue behind another thread's work: it waits for these instead.
#ifndef HOSTCALLBACK_NATIVE_COMPUTATIONS_H_
#define HOSTCALLBACK_NATIVE_COMPUTATIONS_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "record.h"

namespace hostcallback {

inline constexpr uint64_t kNoComputation = UINT64_MAX;

struct ComputationsNow {
  uint64_t begun = 0;           // ids handed out so far: the next one begins with this id
  uint64_t oldest_running = 0;  // the lowest id still running (begun when none is)
  uint64_t running = 0;
  double seconds_since_end = -1;  // since the last one ended; -1 when none has
};

class RunningComputations {
 public:
  // On the thread that runs the computation, which remembers it while it runs (XLA may end
  // it on another thread: entries of computations no longer running are pruned there).
  // run_id: XLA's id of the execution (kUnknownRun where the handler has none).
  uint64_t Begin(int64_t run_id = kUnknownRun);
  // The innermost computation of this device this thread began and still holds, or
  // kNoComputation: the one a tap this thread enqueues now belongs to.
  uint64_t CurrentOnThisThread();
  bool IsRunning(uint64_t id);
  // The running computation of XLA's execution run_id, whichever thread XLA runs its ops on;
  // kNoComputation where none has it (none began: delivery="async"; or it ended already) and,
  // with *unsure set, where the id cannot tell (unknown, or several have it).
  uint64_t OfRun(int64_t run_id, bool* unsure = nullptr);
  // Ends the running computation whose id has these low 32 bits (what a computation carries);
  // returns the reason a failing tap of it left (FailRunning), or "".
  std::string End(uint32_t id_low_bits);
  // Forgets those begun before id that are still running (a computation that failed in a way
  // none of our handlers saw); returns how many.
  size_t Abandon(uint64_t before_id);
  ComputationsNow Now();
  // A tap whose failure fails its computation (a JAX debug callback served by hostcallback, as
  // JAX fails the computation) failed: its computation (id), if it still runs, keeps the first
  // such reason for its fence (End).
  void FailRunning(uint64_t id, const std::string& why);

 private:
  std::mutex mu_;
  uint64_t next_id_ = 0;
  struct Running {
    int64_t run_id = kUnknownRun;
    std::string why;  // why it fails ("" while nothing failed it)
  };
  std::map<uint64_t, Running> running_;  // by id
  std::chrono::steady_clock::time_point last_end_{};
  bool ended_any_ = false;
};

// A handler failed the computation this thread runs: the innermost one this thread began that
// is still running ends now, since XLA runs nothing more of it.
void EndFailedOnThisThread();

// A handler failed the computation of XLA's execution run_id among `computations` (a device's):
// it ends now; none ends where no running one has that id. Where the id cannot tell
// (computations null, run_id unknown or shared), as EndFailedOnThisThread.
void EndFailedRun(RunningComputations* computations, int64_t run_id);

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_COMPUTATIONS_H_
