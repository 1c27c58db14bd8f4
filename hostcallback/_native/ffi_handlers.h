// The XLA FFI handlers our custom calls run on the device thread: hostcallback_tap,
// hostcallback_call and hostcallback_check (module.cc hands them to Python, which registers them
// with jax.ffi for kNativePlatform).
#ifndef HOSTCALLBACK_NATIVE_FFI_HANDLERS_H_
#define HOSTCALLBACK_NATIVE_FFI_HANDLERS_H_

#include "xla/ffi/api/c_api.h"

namespace hostcallback {

// A tap (a barrier marker is a tap of consumer kBarrierMarkerId): attributes consumer_id,
// emit_device; operands the ordering token and the tapped arrays; result the token.
extern "C" XLA_FFI_Error* HostcallbackTap(XLA_FFI_CallFrame* call_frame);

// A `call`: attributes consumer_id, emit_device, timeout_s; results the token, the host's
// answer and, for a call shared over the devices of a sharded computation, a failure flag.
extern "C" XLA_FFI_Error* HostcallbackCall(XLA_FFI_CallFrame* call_frame);

// A shared call's check after its results and flags were summed: attribute consumer_id.
extern "C" XLA_FFI_Error* HostcallbackCheck(XLA_FFI_CallFrame* call_frame);

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_FFI_HANDLERS_H_
