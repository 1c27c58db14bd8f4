// Record-stream frames for many drained records at once (frames.cc), the consumers' fast path:
// the part of the extension that the sinks of hostcallback.consumer use.
#ifndef HOSTCALLBACK_NATIVE_FRAMES_H_
#define HOSTCALLBACK_NATIVE_FRAMES_H_

#include "nanobind/nanobind.h"

namespace hostcallback {

// Adds frame_records() and crc32() to the extension module.
void DefineFrameFunctions(nanobind::module_& m);

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_FRAMES_H_
