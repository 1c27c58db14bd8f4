// A short wait that stays awake. A thread that sleeps on a condition variable is woken by the
// kernel, and on a virtual machine whose other core is idle that costs tens of microseconds
// (the halted vCPU needs an interrupt): more than the receiver's whole round trip for a small
// call or fence. So a wait whose answer usually comes within microseconds first spins, yielding
// its core to any thread that wants it, and sleeps only after that.
#ifndef HOSTCALLBACK_NATIVE_SPIN_WAIT_H_
#define HOSTCALLBACK_NATIVE_SPIN_WAIT_H_

#include <algorithm>
#include <chrono>
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

// SpinYielding with `lock` released, done() checked with its mutex held; `lock` is held again
// when it returns.
template <class Done>
void SpinUnlocked(std::unique_lock<std::mutex>& lock, std::chrono::microseconds limit, Done done) {
  lock.unlock();
  SpinYielding(limit, [&] {
    std::lock_guard<std::mutex> relock(*lock.mutex());
    return done();
  });
  lock.lock();
}

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_SPIN_WAIT_H_
