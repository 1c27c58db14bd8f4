// A short wait that stays awake. A thread that sleeps on a condition variable is woken by the
// kernel, and on a virtual machine whose other core is idle that costs tens of microseconds
// (the halted vCPU needs an interrupt): more than the receiver's whole round trip for a small
// call or fence. So a wait whose answer usually comes within microseconds first spins, yielding
// its core to any thread that wants it, and sleeps only after that.
#ifndef HOSTCALLBACK_NATIVE_SPIN_WAIT_H_
#define HOSTCALLBACK_NATIVE_SPIN_WAIT_H_

#include <chrono>
#include <mutex>
#include <thread>

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
