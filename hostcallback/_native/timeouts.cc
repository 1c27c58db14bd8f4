// Checks timeouts from Python and words the message of a call that timed out.

#include "timeouts.h"

#include <cmath>
#include <cstdio>

namespace hostcallback {

std::string CheckTimeout(double timeout_s) {
  if (std::isnan(timeout_s)) return "timeout must be a number of seconds, not NaN";
  if (timeout_s < 0) return "timeout must not be negative (0 or infinity: wait forever)";
  return "";
}

std::string TimeoutMessage(double timeout_s) {
  char seconds[32];
  std::snprintf(seconds, sizeof(seconds), "%g", timeout_s);
  return std::string(kTimeoutPrefix) + seconds +
         " s. If the call function runs JAX work while a computation over several "
         "devices waits for it, XLA's CPU client may never run that work (it holds at most 32 "
         "computations in flight per device, JAX's own callbacks hang there too): call "
         "jax.block_until_ready on each step's result, or run that work outside the function";
}

}  // namespace hostcallback
