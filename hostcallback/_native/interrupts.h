// Ctrl-C while a device thread waits for the host. JAX runs a computation that holds a native
// call on the thread that dispatched it, Python's main thread, which runs Python's signal
// handlers only when it gets back to Python: a computation of a million steps, each waiting for
// its call's answer, would hold Ctrl-C back until its end. So a wait of the main thread (an
// answer, room in a full queue, its taps to be handled) looks at Python's pending signals every
// kInterruptCheckSeconds, as JAX's own host callbacks do by running Python there; a handler that
// raises (KeyboardInterrupt) ends the wait, and so the computation, with an error. Waits on other
// threads are untouched: their signals wait for the main thread anyway.
#ifndef HOSTCALLBACK_NATIVE_INTERRUPTS_H_
#define HOSTCALLBACK_NATIVE_INTERRUPTS_H_

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>

#include "timeouts.h"

namespace hostcallback {

inline constexpr double kInterruptCheckSeconds = 0.05;

// Chains a SIGINT handler of ours in front of Python's (where Python handles SIGINT and ours is
// not there already: Python's signal.signal() replaces it), which notes that a signal came, so
// that a wait of the main thread looks at Python's signals at once rather than only every
// kInterruptCheckSeconds (a call's answer usually comes within microseconds).
void WatchInterrupts();

// Whether a SIGINT came since the last call (then it forgets it).
bool TakeInterruptNote();

// Seconds since the last SIGINT our handler saw; -1 before the first.
double SecondsSinceInterrupt();

// Notes one as the signal handler does, for a wait that ended without failing on an interruption
// it saw: the next wait looks at Python's signals at once.
void NoteInterrupt();

// Whether this is the thread that runs Python's signal handlers.
bool OnMainThread();

// Takes the GIL and runs Python's pending signal handlers (on the main thread; elsewhere, and
// while the interpreter finalizes, does nothing). When a handler raised, returns what
// ("interrupted (KeyboardInterrupt)") and, for a KeyboardInterrupt, trips SIGINT again, so that
// Python raises it once the computation has ended with its error; else the empty string.
std::string CheckSignals();

// What CheckSignals last returned other than the empty string on this thread.
const std::string& LastInterruption();

// Waits on cv with `lock` held until done(), for at most timeout_s (WaitsForever: no limit), as
// cv.wait_for does; on the main thread it looks at Python's signals (CheckSignals, `lock`
// released) every kInterruptCheckSeconds, and a handler that raised ends the wait with
// *interrupted set. Returns done(); a caller takes *interrupted for the outcome even when done()
// holds too, since the handler's exception was taken from Python (it is pending again only for a
// KeyboardInterrupt) and no later wait may be long enough to see it.
template <class Done>
bool WaitInterruptibly(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                       double timeout_s, Done done, std::string* interrupted) {
  const bool forever = WaitsForever(timeout_s);
  if (!OnMainThread()) {
    if (!forever) return cv.wait_for(lock, std::chrono::duration<double>(timeout_s), done);
    cv.wait(lock, done);
    return true;
  }
  using Clock = std::chrono::steady_clock;
  const auto check_every = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(kInterruptCheckSeconds));
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(forever ? 0.0 : timeout_s));
  // Python's handlers run with `lock` released; true, with *interrupted set, when one raised.
  auto handler_raised = [&] {
    lock.unlock();
    std::string why = CheckSignals();
    lock.lock();
    if (why.empty()) return false;
    *interrupted = why;
    return true;
  };
  while (true) {
    if (TakeInterruptNote() && handler_raised()) return done();
    if (done()) return true;
    auto until = Clock::now() + check_every;
    if (!forever && deadline < until) until = deadline;
    if (cv.wait_until(lock, until, done)) return true;
    if (!forever && Clock::now() >= deadline) return false;
    if (handler_raised()) return done();
  }
}

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_INTERRUPTS_H_
