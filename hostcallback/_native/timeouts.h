// What a timeout from Python means, and the message of a call that ran out of it.
#ifndef HOSTCALLBACK_NATIVE_TIMEOUTS_H_
#define HOSTCALLBACK_NATIVE_TIMEOUTS_H_

#include <string>

namespace hostcallback {

// Waits longer than this (about 31 years) mean "forever": a std::chrono duration of a huge or
// infinite double overflows and would end the wait at once.
inline constexpr double kForeverSeconds = 1e9;

// A timeout that does not wait: 0 would mean forever.
inline constexpr double kAtOnceSeconds = 1e-9;

// timeout_s <= 0 (no timeout given), infinity and anything above kForeverSeconds wait forever.
inline bool WaitsForever(double timeout_s) {
  return timeout_s <= 0 || timeout_s >= kForeverSeconds;
}

// Why a timeout from Python is refused, or the empty string.
std::string CheckTimeout(double timeout_s);

// How TimeoutMessage begins: Python tells a timed-out call by it (CALL_TIMEOUT_PREFIX), and so
// does the handler of a shared call.
inline constexpr char kTimeoutPrefix[] =
    "hostcallback: the host did not answer this call within its timeout of ";

// Why a call failed after timeout_s, and what to do about it.
std::string TimeoutMessage(double timeout_s);

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_TIMEOUTS_H_
