// A short wait that stays awake. A thread that sleeps on a condition variable is woken by the
// kernel, and on a virtual machine whose other core is idle that costs tens of microseconds
// (the halted vCPU needs an interrupt): more than the receiver's whole round trip for a small
// call or fence. So a wait whose answer usually comes within microseconds first spins, yielding
// its core to any other thread ready to run there, and sleeps only after that.
#ifndef HOSTCALLBACK_NATIVE_SPIN_WAIT_H_
#define HOSTCALLBACK_NATIVE_SPIN_WAIT_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>

#include "timeouts.h"

namespace hostcallback {

// Yields until done() holds or `limit` has passed; returns done().
template <class Done>
bool SpinYielding(std::chrono::microseconds limit, Done done) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::yield();
  }
  return true;
}

// `limit`, or less where the wait's own timeout (seconds; WaitsForever: none) is shorter: a
// spin never waits past the timeout of the wait it begins.
inline std::chrono::microseconds SpinWithin(std::chrono::microseconds limit, double timeout_s) {
  if (WaitsForever(timeout_s)) return limit;
  return std::min(limit, std::chrono::duration_cast<std::chrono::microseconds>(
                             std::chrono::duration<double>(timeout_s)));
}

// How often what the waiters on one mutex wait for has changed: whoever changes it bumps this,
// with the mutex held, so that a spin takes the mutex only after a change (SpinUnlocked).
class Changes {
 public:
  void Bump() { count_.fetch_add(1, std::memory_order_release); }
  uint64_t Now() const { return count_.load(std::memory_order_acquire); }

 private:
  std::atomic<uint64_t> count_{0};
};

// With `lock` held, and done() false: SpinYielding with `lock` released, looking at done() (with
// its mutex held) after each change `changes` counts; `lock` is held again when it returns.
template <class Done>
void SpinUnlocked(std::unique_lock<std::mutex>& lock, const Changes& changes,
                  std::chrono::microseconds limit, Done done) {
  if (done()) return;
  uint64_t seen = changes.Now();
  lock.unlock();
  SpinYielding(limit, [&] {
    const uint64_t now = changes.Now();
    if (now == seen) return false;
    seen = now;
    std::lock_guard<std::mutex> relock(*lock.mutex());
    return done();
  });
  lock.lock();
}

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_SPIN_WAIT_H_
